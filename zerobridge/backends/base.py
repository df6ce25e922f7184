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

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from zerobridge.errors import ConfigError

if TYPE_CHECKING:  # importing this module stays torch-free (the launcher reads BACKENDS)
    import torch
    from torch import nn

    from zerobridge.pretrained.targets import Target

__all__ = ["Backend", "attach", "backend_of", "is_prepared"]

_ATTRIBUTE = "_zerobridge_backend"


class Backend(ABC):
    """One prepared model on one engine: what the public API calls."""

    name: ClassVar[str]

    @abstractmethod
    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks; return that norm."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded values under every original name (tied ones under each), with buffers, on every rank."""

    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]:
        """``full_state_dict`` with only rank 0 keeping it (others get ``{}``) and/or the values
        on the host. Here by gathering everything first; the native engine streams."""
        import torch
        import torch.distributed as dist

        state = self.full_state_dict()
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {k: v.cpu() if offload_to_cpu and isinstance(v, torch.Tensor) else v for k, v in state.items()}

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``tier_bytes``, ``comm_bytes``,
        ``comm_calls``, ``loss_scale``, ``skipped_steps`` (see ``zerobridge.stats``)."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Start counting communication from zero."""

    @abstractmethod
    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None,
                        metadata: dict[str, Any] | None) -> Path:
        """Write a sharded checkpoint (the format of ``docs/checkpoints.md``). Collective."""

    @abstractmethod
    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool,
                        rng: bool) -> dict[str, Any]:
        """Load a checkpoint of any layout; return its user metadata. Collective."""

    def pretrained_targets(self) -> list[Target]:
        """The runs of every parameter and buffer this rank holds, for ``load_pretrained``."""
        raise ConfigError(f"load_pretrained cannot write into a model run by the {self.name} backend", key="backend",
                          fix="prepare with backend='native' or 'fsdp', or load the weights into the model before "
                              "prepare (model.load_state_dict)")

    def after_pretrained(self) -> None:
        """After ``load_pretrained`` wrote the targets: make every copy follow. Collective."""


def attach(model: nn.Module, backend: Backend) -> None:
    """Remember which backend runs ``model``."""
    object.__setattr__(model, _ATTRIBUTE, backend)


def is_prepared(model: nn.Module) -> bool:
    """Whether some backend already runs ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def backend_of(model: nn.Module) -> Backend:
    """The backend of a prepared model; a clear error otherwise."""
    backend = getattr(model, _ATTRIBUTE, None)
    if backend is None:
        raise ConfigError(f"{type(model).__name__} was not prepared", key="model",
                          fix="call model = zerobridge.prepare(model, ...) first")
    return backend  # type: ignore[no-any-return]
