"""zerobridge checkpoints from and into a DeepSpeed engine, through whole tensors.

[Note: deepspeed backend checkpoints] ``save`` gathers, parameter by
parameter, the full fp32 master and optimizer state
(``deepspeed.utils.safe_get_full_*``: every rank ends up with every value)
and rank 0 writes them with ``write_portable``, with every rank's RNG
states, the skipped-step count, the param groups (names of the user's
groups), the user's metadata, the scheduler's state and the client state,
while the other ranks wait for it. The result is an ordinary zerobridge
checkpoint (FSDP2 keys, manifest): the native engine and FSDP2 load it at
any stage and world size. ``load``
reads any zerobridge or FSDP2 checkpoint (verified, each rank a share),
every rank all of it, and writes the values into the masters, the compute
parameters and the optimizer's state (``safe_set_full_*``), then restores
the hyperparameters, skipped steps and RNG (rank r takes saved rank
r mod saved world). Memory: the whole model state is materialised on
every rank, once, during a save or a load; fine for models that fit in
host memory, not for the largest ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zerobridge._version import __version__
from zerobridge.backends.deepspeed.config import DeepSpeedPlan
from zerobridge.backends.deepspeed.internals import DeepSpeedInternals, shape_of
from zerobridge.checkpoint.layout import ZB, rank_key
from zerobridge.checkpoint.metadata import read_run_state, run_blobs, saved_ranks
from zerobridge.checkpoint.portable import PortableState, portable_from, write_portable
from zerobridge.checkpoint.reader import open_checkpoint
from zerobridge.checkpoint.rng import capture_rng, restore_rng
from zerobridge.checkpoint.run_state import RunState
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import agree

__all__ = ["DeepSpeedRun", "load", "save"]


class DeepSpeedRun(Protocol):
    """What saving and loading read of the backend (``backend.py``'s ``DeepSpeedRun``)."""

    model: nn.Module
    client: torch.optim.Optimizer
    """The user's optimizer, whose param groups DeepSpeed steps."""
    groups: list[list[str]]
    """Parameter names of each of the client's param groups."""
    plan: DeepSpeedPlan
    internals: DeepSpeedInternals

    def named_params(self) -> list[tuple[nn.Parameter, list[str]]]: ...

    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]: ...


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _group_index(backend: DeepSpeedRun) -> dict[str, int]:
    if len(backend.groups) != len(backend.client.param_groups):
        raise CheckpointError(f"DeepSpeed runs {len(backend.client.param_groups)} param group(s), the optimizer "
                              f"had {len(backend.groups)}", key="optim.param_groups",
                              fix="give every param group at least one trainable parameter")
    return {name: i for i, names in enumerate(backend.groups) for name in names}


def save(backend: DeepSpeedRun, path: Path, *, with_optimizer: bool, run: RunState) -> Path:
    """Write a zerobridge checkpoint of the engine's state. Collective; rank 0 writes."""
    run_blobs(run, distributed=_distributed())  # refuse bad metadata or client state on every rank, first
    model = backend.full_state(rank0_only=False, offload_to_cpu=False)
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    groups: list[dict[str, Any]] = []
    if with_optimizer:
        index = _group_index(backend)
        backend.internals.relink()
        for param, names in backend.named_params():
            if param.requires_grad and names[0] in index:
                state = backend.internals.full_state(param, index[names[0]])
                if state:
                    optimizer[names[0]] = state
        groups = [{k: v for k, v in group.items() if k != "params"} | {"params": names}
                  for group, names in zip(backend.client.param_groups, backend.groups)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    states: list[Any] = [capture_rng()]
    if _distributed():
        states = [None] * world
        dist.all_gather_object(states, capture_rng())
    extras = {rank_key(rank, name): value for rank, saved in enumerate(states) for name, value in saved.items()}
    extras[f"{ZB}.skipped_steps"] = torch.tensor(backend.internals.skipped_steps, dtype=torch.int64)
    stage = backend.plan.config["zero_optimization"]["stage"]
    compute = "bfloat16" if backend.plan.config["bf16"]["enabled"] else "float32"
    layout = {"world_size": world, "shard_size": world if stage else 1, "replicas": 1 if stage else world,
              "strategy": f"DeepSpeed ZeRO stage {stage} (deepspeed backend, written whole by rank 0)",
              "master_dtype": "float32", "compute_dtype": compute, "zerobridge": __version__,
              "torch": str(torch.__version__)}
    error: BaseException | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write_portable(path, PortableState(model=model, optimizer=optimizer, param_groups=groups,
                                               metadata=run.metadata, scheduler=run.scheduler,
                                               client_state=run.client_state), extras=extras, layout=layout)
        except (OSError, CheckpointError) as exc:
            error = exc
    agree(_distributed(), error)
    return path


def load(backend: DeepSpeedRun, path: Path, *, with_optimizer: bool, strict: bool, rng: bool,
         with_scheduler: bool = False, verify: bool = True) -> RunState:
    """Load any zerobridge (or FSDP2) checkpoint into the engine. Collective."""
    ckpt = open_checkpoint(path, distributed=_distributed(), verify=verify)
    read_run_state(ckpt, with_scheduler=with_scheduler, strict=strict)  # refuses early what is missing
    state = portable_from(ckpt, optimizer=with_optimizer)
    params = backend.named_params()
    values: dict[int, torch.Tensor] = {}
    missing: list[str] = []
    for param, names in params:
        name = next((n for n in names if n in state.model), None)
        if name is None:
            missing.append(names[0])
            continue
        if tuple(state.model[name].shape) != tuple(shape_of(param)):
            raise CheckpointError(f"has shape {tuple(state.model[name].shape)}; the model's parameter has "
                                  f"{tuple(shape_of(param))}", source=ckpt.source, key=f"model.{name}",
                                  fix="load into the model architecture that saved it")
        values[id(param)] = state.model[name]
    known = {n for _, names in params for n in names}
    buffers = {n: b for n, b in backend.model.state_dict().items() if n not in known}
    missing += [n for n in buffers if n not in state.model]
    unexpected = sorted(set(state.model) - known - set(buffers))
    if strict and (missing or unexpected):
        raise CheckpointError(f"does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})",
                              source=ckpt.source, key="model",
                              fix="load into the model that saved it, or pass strict=False to load what matches")
    backend.internals.set_masters(values)
    with torch.no_grad():
        for name, buffer in buffers.items():
            if name in state.model:
                buffer.copy_(state.model[name])
    if with_optimizer:
        _load_optimizer(backend, state, params, strict=strict, source=ckpt.source)
    if ckpt.tensor(f"{ZB}.skipped_steps") is not None:
        backend.internals.skipped_steps = int(ckpt.full(f"{ZB}.skipped_steps"))
    ranks = saved_ranks(ckpt)
    if rng and ranks:
        mine = ranks.get((dist.get_rank() if dist.is_initialized() else 0) % len(ranks), {})
        restore_rng({name: ckpt.full(key) for name, key in mine.items()})
    return RunState(metadata=state.metadata, scheduler=state.scheduler, client_state=state.client_state)


def _load_optimizer(backend: DeepSpeedRun, state: PortableState, params: list[Any], *, strict: bool,
                    source: str) -> None:
    if not state.param_groups:
        if strict:
            raise CheckpointError("holds no optimizer state", source=source, key="optim",
                                  fix="pass optimizer=None to load the model only, or strict=False")
        return
    index = _group_index(backend)
    frozen = {names[0] for param, names in params if not param.requires_grad}
    if len(state.param_groups) != len(backend.groups):
        raise CheckpointError(f"holds {len(state.param_groups)} optimizer param group(s); this optimizer has "
                              f"{len(backend.groups)}", source=source, key="optim.param_groups",
                              fix="build the optimizer's param groups as the saving run did (or pass optimizer=None)")
    for i, (saved, group) in enumerate(zip(state.param_groups, backend.client.param_groups)):
        theirs, ours = set(saved.get("params", [])) - frozen, set(backend.groups[i]) - frozen
        if "params" in saved and theirs != ours:
            raise CheckpointError(f"group {i} holds {sorted(theirs - ours)[:3]} that this optimizer's group {i} "
                                  f"lacks, and lacks {sorted(ours - theirs)[:3]}", source=source,
                                  key=f"optim.param_groups.{i}.params",
                                  fix="put the same parameters in each group as the saving run did")
        group.update({k: v for k, v in saved.items() if k != "params"})
    if not state.optimizer:
        return
    backend.internals.ensure_state()
    for param, names in params:
        saved_state = next((state.optimizer[n] for n in names if n in state.optimizer), None)
        if param.requires_grad and saved_state is not None and names[0] in index:
            backend.internals.set_state(param, index[names[0]], saved_state)
