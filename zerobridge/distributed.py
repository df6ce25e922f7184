"""Starting the default process group, with this rank's accelerator bound first.

    >>> import torch
    >>> from zerobridge.distributed import backend_for, bound_device
    >>> backend_for(torch.device("cuda", 1)), backend_for(torch.device("cpu"))
    ('nccl', 'gloo')
    >>> bound_device(torch.device("cpu"), local_rank=3)
    device(type='cpu')
    >>> bound_device(torch.device("cuda"), local_rank=3)
    device(type='cuda', index=3)

Under a launcher, rank ``r`` of a node uses accelerator ``LOCAL_RANK``, as
FSDP2 and torchtitan do: ``init_distributed`` makes it the current device
(``torch.cuda.set_device``) and passes it as ``device_id`` to
``init_process_group``, so NCCL binds each rank to its own GPU and object
collectives and barriers stop landing every rank on ``cuda:0``. A model on
the CPU under a group with no CPU path (NCCL alone) is refused: its
collectives could not run.

Host tensors (offloaded master values, a full state gathered to the host,
checkpoint control messages) never go to a group whose backend has no CPU
path (NCCL): ``carries_host`` tells, and ``host_world`` is the default group
when it is gloo, else a gloo group over every rank, made once.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from zerobridge import env
from zerobridge.errors import ConfigError

__all__ = ["backend_for", "bind_device", "bound_device", "carries_host", "check_group_device", "group_timeout",
           "host_world", "init_distributed", "launched", "run_device"]

_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}
_HOST_WORLD: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []  # (default group, its gloo twin)


def carries_host(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default group) takes CPU tensors: gloo does, NCCL alone does not."""
    config = str(dist.get_backend_config(group))  # "cpu:gloo,cuda:nccl", "cuda:nccl", ...
    return any(part.split(":")[0] == "cpu" for part in config.split(","))


def host_world() -> dist.ProcessGroup:
    """A gloo group over every rank: the default group when it is one, else a group created
    on the first call (collective then; later calls return it)."""
    default = dist.distributed_c10d._get_default_group()
    if carries_host(default) and dist.get_backend(default) == "gloo":  # gloo alone: monitored barriers work
        return default
    for owner, twin in _HOST_WORLD:
        if owner is default:
            return twin
    _HOST_WORLD.clear()  # the default group was replaced: its twin went with it
    twin = dist.new_group(backend="gloo", timeout=group_timeout())
    _HOST_WORLD.append((default, twin))
    return twin


def group_timeout() -> datetime.timedelta:
    """How long a collective may wait for its peers before it raises.

    ``ZEROBRIDGE_TIMEOUT`` (seconds) when set; else the default group's own
    timeout (torch gives new groups 30 minutes, not the default group's).
    """
    if os.environ.get(env.TIMEOUT):
        return datetime.timedelta(seconds=float(os.environ[env.TIMEOUT]))
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        for device in (torch.device("cpu"), torch.device("cuda")):
            try:
                return default._get_backend(device).options._timeout
            except (RuntimeError, AttributeError):
                continue
    return datetime.timedelta(seconds=600)


def launched() -> bool:
    """Whether a launcher (torchrun, ``zerobridge run``) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_device() -> torch.device:
    """The device of this rank's tensors: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device``: NCCL on CUDA, gloo on the CPU."""
    return _BACKENDS.get(device.type, "gloo")


def bound_device(device: torch.device, *, local_rank: int) -> torch.device:
    """The accelerator this rank uses: ``device``'s type at index ``local_rank`` (the CPU stays)."""
    return device if device.type == "cpu" else torch.device(device.type, local_rank)


def bind_device(device: torch.device) -> torch.device:
    """Make ``LOCAL_RANK``'s accelerator the current one and return it; ``ConfigError`` when
    the model sits on another one (``model.cuda()`` before ``set_device`` puts every rank on 0)."""
    if device.type == "cpu":
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    bound = bound_device(device, local_rank=local_rank)
    if device.index is not None and device.index != local_rank:
        raise ConfigError(f"the parameters are on {device} but LOCAL_RANK={local_rank} binds {bound}: every rank "
                          f"would share {device}", key="model",
                          fix="call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before moving the model, or "
                              "move it with model.to(f\"cuda:{os.environ['LOCAL_RANK']}\")")
    getattr(torch, device.type).set_device(bound)
    return bound


def check_group_device(device: torch.device) -> None:
    """``ConfigError`` when the default group cannot carry tensors of ``device`` (a CPU model
    under NCCL alone)."""
    if device.type == "cpu" and not carries_host():
        raise ConfigError(f"the model is on the CPU but the process group's backend "
                          f"({dist.get_backend_config()}) has no CPU path: its collectives would fail",
                          key="model", fix="move the model to its GPU before prepare "
                          "(model.to(f\"cuda:{os.environ['LOCAL_RANK']}\")), or start the group with "
                          "backend=\"gloo\" (or \"cpu:gloo,cuda:nccl\") to train on the CPU")


def init_distributed(model: torch.nn.Module | None, device: torch.device | None = None) -> None:
    """Start the default process group unless there is one, then check it fits the model.

    Under a launcher: NCCL bound to ``cuda:$LOCAL_RANK`` (``set_device`` and
    ``device_id``) when the model is on CUDA, else gloo; under plain python a
    one-rank gloo group. ``device``: where the model will live (default:
    where its parameters are; the CPU without a model). Draws no random
    numbers: a script's seed holds across it.
    """
    if device is not None:
        device = torch.device(device)
    else:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    if launched() and device.type != "cpu":
        device = bind_device(device)
    if not dist.is_initialized():
        timeout = group_timeout()
        if launched():
            bound = None if device.type == "cpu" else device
            dist.init_process_group(backend_for(device), timeout=timeout, device_id=bound)
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    check_group_device(device)
