"""What every backend gives the user's loop, whichever engine runs underneath.

    >>> import torch
    >>> from zerobridge.backends.base import is_prepared
    >>> is_prepared(torch.nn.Linear(2, 2))
    False

``zerobridge.prepare(..., backend=...)`` builds one ``Backend`` and attaches
it to the model; ``clip_grad_norm_``, ``full_state_dict``, ``stats``,
``reset_stats`` and the checkpoint calls then ask ``backend_of(model)``. The
user's loop (``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``) is the same on every backend.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.checkpoint.run_state import RunState
from zerobridge.distributed import init_distributed
from zerobridge.errors import ConfigError
from zerobridge.pretrained.targets import Target
from zerobridge.runtime.deferred_init import Replay, replay_on_every_rank
from zerobridge.runtime.window import AccumulationWindow
from zerobridge.spec import StrategySpec

__all__ = ["Backend", "adopt_class", "backend_of", "check_fresh", "is_prepared", "keep_where_asked", "set_backend",
           "start_run"]

_ATTRIBUTE = "_zerobridge_backend"


class Backend(ABC):
    """One prepared model on one engine: what the public API calls."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def spec(self) -> StrategySpec:
        """The spec the model runs: what ``prepare`` resolved from its arguments or the environment
        (what the backend runs differently is in ``stats()["approximations"]``)."""

    @property
    @abstractmethod
    def window(self) -> AccumulationWindow:
        """The accumulation window the model's backward passes follow (``runtime/window.py``)."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks; return that norm."""

    @abstractmethod
    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]:
        """Unsharded values under every original name (tied ones under each), with buffers. Collective.
        ``rank0_only``: only rank 0 keeps them (the others get ``{}``); ``offload_to_cpu``: in host memory."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``tier_bytes``, ``comm_bytes``,
        ``comm_calls``, ``loss_scale``, ``skipped_steps`` (see ``zerobridge.stats``)."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Start counting communication from zero."""

    @abstractmethod
    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, run: RunState) -> Path:
        """Write a sharded checkpoint (the format of ``docs/checkpoints.md``), with ``run``'s metadata,
        scheduler state and client state written once, by rank 0 (``checkpoint.metadata.run_blobs``). Collective."""

    @abstractmethod
    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool, rng: bool,
                        with_scheduler: bool, verify: bool = True) -> RunState:
        """Load a checkpoint of any layout; return its run state (``checkpoint.metadata.read_run_state``, read
        before anything is loaded: ``with_scheduler`` and ``strict`` refuse one without scheduler state).
        ``verify``: files checked against the manifest first (``checkpoint.reader.open_checkpoint``).
        Collective."""

    def pretrained_targets(self) -> list[Target]:
        """The runs of every parameter and buffer this rank holds, for ``load_pretrained``."""
        raise ConfigError(f"load_pretrained cannot write into a model run by the {self.name} backend", key="backend",
                          fix="prepare with backend='native' or 'fsdp', or load the weights into the model before "
                              "prepare (model.load_state_dict)")

    def after_pretrained(self) -> None:
        """After ``load_pretrained`` wrote the targets: make every copy follow. Collective.

        A hook with a default, not an abstract method: a backend whose targets are the only copy
        of each value has nothing to follow, so the default does nothing."""
        return None


def keep_where_asked(state: dict[str, torch.Tensor], *, rank0_only: bool, offload_to_cpu: bool
                     ) -> dict[str, torch.Tensor]:
    """A full state gathered on every rank, kept as ``Backend.full_state`` was asked: only on rank 0,
    and/or moved to host memory."""
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {k: v.cpu() if offload_to_cpu and isinstance(v, torch.Tensor) else v for k, v in state.items()}


def set_backend(model: nn.Module, backend: Backend) -> None:
    """Remember which backend runs ``model``."""
    object.__setattr__(model, _ATTRIBUTE, backend)


def is_prepared(model: nn.Module) -> bool:
    """Whether some backend already runs ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def backend_of(model: nn.Module) -> Backend:
    """The backend of a prepared model; a clear error otherwise."""
    backend = getattr(model, _ATTRIBUTE, None)
    if not isinstance(backend, Backend):
        raise ConfigError(f"{type(model).__name__} was not prepared", key="model",
                          fix="call model = zerobridge.prepare(model, ...) first")
    return backend


def check_fresh(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """``ConfigError`` unless ``model`` is prepared for the first time and ``optimizer`` has not stepped."""
    if is_prepared(model):
        raise ConfigError(f"{type(model).__name__} is already prepared", key="model",
                          fix="call zerobridge.prepare once per model")
    if optimizer is not None and any(optimizer.state.values()):
        raise ConfigError("the optimizer has already stepped (it holds state)", key="optimizer",
                          fix="call zerobridge.prepare before the first optimizer.step()")


def start_run(model: nn.Module, replay: Replay | None, device: torch.device | None) -> tuple[int, int]:
    """What every backend does first: start (or join) the default process group with this rank's
    accelerator bound, and record a meta-device model's construction from rank 0's generator.
    Returns (world size, ranks per node). Collective."""
    init_distributed(model, device)
    if replay is not None:
        assert device is not None, "a meta-device model names the device it materializes on"
        replay_on_every_rank(replay, device)
    world = dist.get_world_size()
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


_CLASSES: dict[tuple[type, type, str], type] = {}


def adopt_class(model: nn.Module, mixin: type, prefix: str) -> None:
    """Give ``model`` the class ``<prefix><Class>(mixin, Class)``, made once per class: the model keeps its
    own class, methods and names, and gains the backend's (``no_sync``, the calls routed to an engine)."""
    cls = type(model)
    key = (cls, mixin, prefix)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    model.__class__ = _CLASSES[key]
