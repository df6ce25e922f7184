"""A model run by torch FSDP2 under a zerobridge spec: what the public API asks of it.

    >>> from zerobridge.backends.fsdp.backend import FsdpBackend
    >>> FsdpBackend.name
    'fsdp'

``zerobridge.stats`` counts storages (FSDP2 keeps padded shards) and the
collectives FSDP2 issues (``runtime/comm_stats.py``); clipping and the
accumulation window are the stepper's (``step.py``); checkpoints are
zerobridge's format (``checkpoint.py``), pretrained weights go straight into
each rank's local shards (``targets.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerobridge.backends.base import Backend, backend_of, keep_where_asked
from zerobridge.backends.fsdp.assess import Assessment
from zerobridge.backends.fsdp.checkpoint import load_fsdp, save_fsdp
from zerobridge.backends.fsdp.step import FsdpStepper
from zerobridge.backends.fsdp.targets import dtensor_targets
from zerobridge.checkpoint.run_state import RunState
from zerobridge.pretrained.targets import Target
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.plan import RunPlan
from zerobridge.runtime.tensors import StorageCounter
from zerobridge.runtime.window import AccumulationWindow
from zerobridge.spec import StrategySpec
from zerobridge.translate.report import Entry, Report

__all__ = ["FsdpBackend", "ZeroFsdpModule"]


class FsdpBackend(Backend):
    """A model run by torch FSDP2 (``fully_shard``) under a zerobridge spec."""

    name: ClassVar[str] = "fsdp"

    def __init__(self, model: nn.Module, plan: RunPlan, mesh: DeviceMesh, stepper: FsdpStepper,
                 stats: CommStats, assessment: Assessment, approximations: list[Entry]) -> None:
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.stepper = stepper
        self.comm = stats
        self.assessment = assessment
        self.approximations = approximations
        """What runs differently from the spec (non-empty only with ``allow_approximate=True``)."""
        self.report = Report(source="spec", target="fsdp backend")
        """Every translator entry that is not exact, as this backend runs it."""
        for entry in [*approximations, *assessment.tuning, *assessment.equivalent]:
            self.report.add(entry.key, entry.status, entry.note, target=entry.target)
        self.offloaded = assessment.form["offload_policy"] is not None

    @property
    def window(self) -> AccumulationWindow:
        return self.stepper.window

    @property
    def spec(self) -> StrategySpec:
        return self.plan.spec

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.stepper.clip_grad_norm(max_norm, norm_type)

    def full_state(self, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, torch.Tensor]:
        gathered: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            if isinstance(value, DTensor):
                if id(value) not in gathered:  # a tied weight is gathered once, kept under each name
                    gathered[id(value)] = value.full_tensor().detach()
                out[name] = gathered[id(value)]
            else:
                out[name] = value
        return keep_where_asked(out, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    def stats(self) -> dict[str, Any]:
        params = self.stepper.params
        sizes = {
            "param_bytes": StorageCounter().add(params),  # FSDP2 keeps padded shards: count storages
            "grad_bytes": StorageCounter().add([p.grad for p in params] + list(self.stepper.set_aside.values())),
            "optimizer_bytes": StorageCounter().add(v for opt in list(self.stepper.optimizers)
                                                    for p in params for v in opt.state.get(p, {}).values()
                                                    if isinstance(v, torch.Tensor)),
        }
        tier = "host" if self.offloaded else "device"
        tiers = {"device": 0, "host": 0, "nvme": 0}
        tiers[tier] = sum(sizes.values())
        return {**sizes, "tier_bytes": tiers, "comm_bytes": dict(self.comm.bytes), "comm_calls": dict(self.comm.calls),
                "loss_scale": self.stepper.scaler.scale, "skipped_steps": self.stepper.skipped_steps,
                "approximations": [{"key": e.key, "status": e.status.value, "note": e.note}
                                   for e in self.approximations]}

    def reset_stats(self) -> None:
        self.comm.reset()

    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, run: RunState) -> Path:
        return save_fsdp(path, self, optimizer, run)

    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool, rng: bool,
                        with_scheduler: bool, verify: bool = True) -> RunState:
        return load_fsdp(path, self, optimizer, strict=strict, rng=rng, with_scheduler=with_scheduler, verify=verify)

    def pretrained_targets(self) -> list[Target]:
        return dtensor_targets(self.model)


class ZeroFsdpModule(nn.Module):
    """Mixed into a prepared model's class (after FSDP2's own): ``no_sync`` as on the native engine."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient communication: accumulate locally until a backward outside."""
        backend = backend_of(self)
        assert isinstance(backend, FsdpBackend)
        return backend.stepper.no_sync()
