"""A model run by zerobridge's own engine: what the public API asks of it.

    >>> import torch, zerobridge
    >>> from zerobridge.backends.base import backend_of
    >>> model = zerobridge.prepare(torch.nn.Linear(4, 2), stage=1)
    >>> backend_of(model).name, sorted(zerobridge.stats(model)["tier_bytes"])
    ('native', ['device', 'host', 'nvme'])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from zerobridge.backends.base import Backend
from zerobridge.backends.native.targets import engine_targets
from zerobridge.checkpoint.run_state import RunState
from zerobridge.engine import Engine
from zerobridge.engine.local_runs import refresh_compute
from zerobridge.engine.state import full_state_dict
from zerobridge.pretrained.targets import Target
from zerobridge.runtime.window import AccumulationWindow
from zerobridge.spec import StrategySpec

__all__ = ["NativeBackend"]


class NativeBackend(Backend):
    """A model run by zerobridge's own engine."""

    name: ClassVar[str] = "native"

    def __init__(self, model: nn.Module, engine: Engine) -> None:
        self.model = model
        self.engine = engine

    @property
    def window(self) -> AccumulationWindow:
        return self.engine.window

    @property
    def spec(self) -> StrategySpec:
        return self.engine.plan.spec

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.engine.clip_grad_norm(max_norm, norm_type)

    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]:
        engine = self.engine
        return full_state_dict(self.model, engine.groups, engine.mesh, engine.stats, rank0_only=rank0_only,
                               offload_to_cpu=offload_to_cpu)

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {**engine.memory(), "comm_bytes": dict(engine.stats.bytes), "comm_calls": dict(engine.stats.calls),
                "loss_scale": engine.stepper.scaler.scale, "skipped_steps": engine.stepper.skipped_steps}

    def reset_stats(self) -> None:
        self.engine.stats.reset()

    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, run: RunState) -> Path:
        from zerobridge.backends.native.checkpoint import save_native  # lazy: loads torch.distributed.checkpoint

        return save_native(path, self.model, self.engine, optimizer, run)

    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool, rng: bool,
                        with_scheduler: bool, verify: bool = True) -> RunState:
        from zerobridge.backends.native.checkpoint import load_native  # lazy: loads torch.distributed.checkpoint

        return load_native(path, self.model, self.engine, optimizer, strict=strict, rng=rng,
                           with_scheduler=with_scheduler, verify=verify)

    def pretrained_targets(self) -> list[Target]:
        return engine_targets(self.engine)

    def after_pretrained(self) -> None:
        refresh_compute(self.engine)
