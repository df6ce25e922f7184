"""A model run by a ``deepspeed.DeepSpeedEngine`` under a zerobridge spec: what the public API asks of it.

    >>> from zerobridge.backends.deepspeed.backend import DeepSpeedBackend
    >>> DeepSpeedBackend.name
    'deepspeed'

Everything DeepSpeed keeps privately (masters, optimizer state, the norm its
step computes) is reached through ``internals.py``; the user's loop is the
stepper's (``step.py``); checkpoints are zerobridge's format
(``checkpoint.py``). ``load_pretrained`` is refused (``Backend``'s default):
DeepSpeed keeps its own fp32 partitions inside the optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from zerobridge.backends.base import Backend, keep_where_asked
from zerobridge.backends.deepspeed.checkpoint import load, save
from zerobridge.backends.deepspeed.config import DeepSpeedPlan
from zerobridge.backends.deepspeed.internals import DeepSpeedInternals, held_bytes
from zerobridge.backends.deepspeed.step import DeepSpeedOptimizer, DeepSpeedStepper
from zerobridge.checkpoint.run_state import RunState
from zerobridge.errors import ConfigError
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.window import AccumulationWindow
from zerobridge.spec import StrategySpec

__all__ = ["DeepSpeedBackend"]


class DeepSpeedBackend(Backend):
    """A model run by a ``deepspeed.DeepSpeedEngine``."""

    name: ClassVar[str] = "deepspeed"

    def __init__(self, model: nn.Module, engine: Any, client: torch.optim.Optimizer, plan: DeepSpeedPlan,
                 comm: CommStats, groups: list[list[str]]) -> None:
        self.model = model
        self.engine = engine
        self.client = client
        self.plan = plan
        self.report = plan.report
        """The translator's report: what each spec key became in DeepSpeed's config."""
        self.comm = comm
        self.groups = groups
        """Names of the parameters of each param group the client optimizer had (empty groups dropped,
        as DeepSpeed drops them)."""
        self.internals = DeepSpeedInternals(engine, model, client)
        self.stepper = DeepSpeedStepper(engine, model, self.internals, comm,
                                        accumulation_steps=plan.accumulation_steps, clip=plan.clip)
        self.optimizer = DeepSpeedOptimizer(self.stepper, client)
        zero = plan.config["zero_optimization"]
        self.offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") != "none"
        self.offload_params = zero.get("offload_param", {}).get("device", "none") != "none"

    @property
    def window(self) -> AccumulationWindow:
        return self.stepper.window

    @property
    def spec(self) -> StrategySpec:
        return self.plan.spec

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.stepper.clip_grad_norm(max_norm, norm_type)

    def named_params(self) -> list[tuple[nn.Parameter, list[str]]]:
        """Each parameter once, with all its names (a tied weight has several)."""
        found: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            found.setdefault(id(param), (param, []))[1].append(name)
        return list(found.values())

    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        with self.stepper.counting():
            for param, names in self.named_params():
                value = self.internals.full_master(param)
                for name in names:
                    state[name] = value
        return keep_where_asked(state, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    def stats(self) -> dict[str, Any]:
        scale = getattr(self.engine.optimizer, "loss_scale", 1.0)
        return {**held_bytes(self.internals, offload_optimizer=self.offload_optimizer,
                             offload_params=self.offload_params),
                "comm_bytes": dict(self.comm.bytes), "comm_calls": dict(self.comm.calls),
                "loss_scale": float(scale), "skipped_steps": self.internals.skipped_steps,
                "approximations": [{"key": e.key, "status": e.status.value, "note": e.note}
                                   for e in self.plan.approximations]}

    def reset_stats(self) -> None:
        self.comm.reset()

    def _check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None and optimizer is not self.optimizer and optimizer is not self.client:
            raise ConfigError("this optimizer is not the one zerobridge.prepare returned for the model",
                              key="optimizer", fix="pass the optimizer prepare returned")

    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, run: RunState) -> Path:
        self._check_optimizer(optimizer)
        with self.stepper.counting():
            return save(self, path, with_optimizer=optimizer is not None, run=run)

    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool, rng: bool,
                        with_scheduler: bool, verify: bool = True) -> RunState:
        self._check_optimizer(optimizer)
        with self.stepper.counting():
            return load(self, path, with_optimizer=optimizer is not None, strict=strict, rng=rng,
                        with_scheduler=with_scheduler, verify=verify)
