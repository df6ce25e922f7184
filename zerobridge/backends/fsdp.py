"""torch FSDP2 as a backend: ``zerobridge.prepare(..., backend="fsdp")``.

    import torch, zerobridge

    model = zerobridge.prepare(model, stage=3, backend="fsdp")        # or ZEROBRIDGE_BACKEND=fsdp
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss = model(batch); loss.backward()
    zerobridge.clip_grad_norm_(model, 1.0)
    optimizer.step(); optimizer.zero_grad()
    zerobridge.stats(model)["approximations"]                        # [] unless allow_approximate=True

The spec goes through the FSDP2 translator (``write_fsdp2``) and its report
is judged by ``fsdp_plan.assess``: what FSDP2 cannot run exactly (ZeRO-1,
ZeRO-2's replicated parameters, offloading one tier alone, NVMe) is refused
with the key and the fix, or with ``allow_approximate=True`` run as the
closest FSDP2 form and listed in ``stats()["approximations"]``. Then
``fully_shard`` runs on each native wrap unit (innermost first, the root
last) over a mesh built here (``[world]``, or ``[replicas, shard]`` for
hybrid sharding and ``[world, 1]`` for stage 0) with the spec's
``MixedPrecisionPolicy`` (fp32 sharded parameters are the master weights) and
``CPUOffloadPolicy``. Accumulation, averaging, clipping and fp16 loss
scaling follow the native engine (``fsdp_step.py``); checkpoints are
zerobridge's (``fsdp_checkpoint.py``). docs/backends.md has the whole mapping.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from zerobridge.runtime import comm_stats
from zerobridge.backends.base import Backend, attach, backend_of
from zerobridge.backends.fsdp_apply import (
    apply_activation_checkpointing, apply_fully_shard, broadcast_from_rank0, build_mesh, cast_states, first_names,
    plan_units, replace_optimizer_params, shard_group,
)
from zerobridge.backends.fsdp_materialize import materialize_fsdp
from zerobridge.backends.fsdp_plan import Assessment, assess, refuse
from zerobridge.backends.fsdp_step import FsdpStepper
from zerobridge.runtime.tensors import StorageCounter
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.compile import apply_compile
from zerobridge.runtime.plan import RunPlan, plan_run
from zerobridge.runtime.step_rules import install_optimizer_hooks
from zerobridge.errors import ConfigError
from zerobridge.distributed import init_distributed
from zerobridge.runtime.deferred_init import Replay, replay_on_every_rank
from zerobridge.spec import StrategySpec
from zerobridge.translate.report import Entry, Report

__all__ = ["FsdpBackend", "ZeroFsdpModule", "prepare"]


class FsdpBackend(Backend):
    """A model run by torch FSDP2 (``fully_shard``) under a zerobridge spec."""

    name: ClassVar[str] = "fsdp"

    def __init__(self, model: nn.Module, plan: RunPlan, mesh: DeviceMesh, stepping: FsdpStepper,
                 stats: CommStats, assessment: Assessment, approximations: list[Entry]) -> None:
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.stepping = stepping
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
    def shard_size(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.stepping.clip_grad_norm(max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        gathered: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            if isinstance(value, DTensor):
                if id(value) not in gathered:  # a tied weight is gathered once, kept under each name
                    gathered[id(value)] = value.full_tensor().detach()
                out[name] = gathered[id(value)]
            else:
                out[name] = value
        return out

    def stats(self) -> dict[str, Any]:
        params = self.stepping.params
        sizes = {
            "param_bytes": StorageCounter().add(params),  # FSDP2 keeps padded shards: count storages
            "grad_bytes": StorageCounter().add([p.grad for p in params] + list(self.stepping.set_aside.values())),
            "optimizer_bytes": StorageCounter().add(v for opt in list(self.stepping.optimizers)
                                                    for p in params for v in opt.state.get(p, {}).values()
                                                    if isinstance(v, torch.Tensor)),
        }
        tier = "host" if self.offloaded else "device"
        tiers = {"device": 0, "host": 0, "nvme": 0}
        tiers[tier] = sum(sizes.values())
        return {**sizes, "tier_bytes": tiers, "comm_bytes": dict(self.comm.bytes), "comm_calls": dict(self.comm.calls),
                "loss_scale": self.stepping.scaler.scale, "skipped_steps": self.stepping.skipped_steps,
                "approximations": [{"key": e.key, "status": e.status.value, "note": e.note}
                                   for e in self.approximations]}

    def reset_stats(self) -> None:
        self.comm.reset()

    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None,
                        metadata: dict[str, Any] | None) -> Path:
        from zerobridge.backends.fsdp_checkpoint import save_fsdp

        return save_fsdp(path, self, optimizer, metadata)

    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool,
                        rng: bool) -> dict[str, Any]:
        from zerobridge.backends.fsdp_checkpoint import load_fsdp

        return load_fsdp(path, self, optimizer, strict=strict, rng=rng)

    def pretrained_targets(self) -> list[Any]:
        from zerobridge.pretrained.targets import dtensor_targets

        return dtensor_targets(self.model)


class ZeroFsdpModule(nn.Module):
    """Mixed into a prepared model's class (after FSDP2's own): ``no_sync`` as on the native engine."""

    def no_sync(self) -> Any:
        """Skip gradient communication: accumulate locally until a backward outside."""
        backend = backend_of(self)
        assert isinstance(backend, FsdpBackend)
        return backend.stepping.no_sync()


_CLASSES: dict[type, type] = {}


def _check_model(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    try:
        backend_of(model)
    except ConfigError:
        pass
    else:
        raise ConfigError(f"{type(model).__name__} is already prepared", key="model",
                          fix="call zerobridge.prepare once per model")
    if isinstance(model, FSDPModule):
        raise ConfigError(f"{type(model).__name__} is already sharded by fully_shard", key="model",
                          fix="pass the plain model: zerobridge calls fully_shard itself")
    if optimizer is not None and any(optimizer.state.values()):
        raise ConfigError("the optimizer has already stepped (it holds state)", key="optimizer",
                          fix="call zerobridge.prepare before the first optimizer.step()")


def fully_shard_kwargs(assessment: Assessment, plan: RunPlan, mesh: DeviceMesh) -> dict[str, Any]:
    """``fully_shard``'s keywords: the translated form, with dtypes as the native engine resolves them."""
    form = assessment.form
    output = form["mp_policy"]["output_dtype"]
    mp = MixedPrecisionPolicy(param_dtype=plan.compute_dtype, reduce_dtype=plan.reduce_dtype,
                              output_dtype=getattr(torch, output) if output else None,
                              cast_forward_inputs=form["mp_policy"]["cast_forward_inputs"])
    offload = form["offload_policy"]
    policy = OffloadPolicy() if offload is None else \
        CPUOffloadPolicy(pin_memory=bool(offload["pin_memory"]) and torch.cuda.is_available())
    return {"mesh": mesh, "reshard_after_forward": form["reshard_after_forward"], "mp_policy": mp,
            "offload_policy": policy}


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
            allow_approximate: bool, replay: Replay | None = None, device: torch.device | None = None
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``spec`` on torch FSDP2: shard ``model`` in place; return it, or ``(model, optimizer)``
    with the optimizer's parameters replaced by the sharded ones (groups and hyperparameters kept).
    ``replay``: the model is on the meta device; it is sharded there and each rank's shards are
    materialized on ``device`` with the eager values (``fsdp_materialize``)."""

    _check_model(model, optimizer)
    init_distributed(model, device)
    if replay is not None:
        assert device is not None, "a meta-device model names the device it materializes on"
        replay_on_every_rank(replay, device)
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = plan_run(spec, world_size=world)
    assessment = assess(spec, world_size=world, local_world_size=local_world,
                        accumulation_steps=plan.accumulation_steps)
    cut = plan_units(model, spec.wrapping)
    approximations = assessment.approximations + cut.merged
    if not allow_approximate:
        refuse(approximations)
    stats = CommStats()
    comm_stats.count_into(stats)
    before = first_names(model)
    device_type = device.type if replay is not None and device is not None else next(model.parameters()).device.type
    mesh = build_mesh(assessment.form["mesh"], world_size=world, device_type=device_type)
    if replay is None:
        broadcast_from_rank0(model)
    cast_states(model, master=plan.master_dtype, buffers=plan.buffer_dtype)
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model, spec.wrapping)
    apply_fully_shard(model, cut, fully_shard_kwargs(assessment, plan, mesh))
    if replay is not None:
        assert device is not None
        materialize_fsdp(model, replay, device, offloaded=assessment.form["offload_policy"] is not None)
    apply_compile([model, *cut.sharded], spec.compile)
    stepping = FsdpStepper(model, plan, shard_group(mesh))
    install_optimizer_hooks(stepping)
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Zero{cls.__name__}", (ZeroFsdpModule, cls), {"__module__": cls.__module__})
    model.__class__ = _CLASSES[cls]
    attach(model, FsdpBackend(model, plan, mesh, stepping, stats, assessment, approximations))
    stats.reset()
    if optimizer is None:
        return model
    replace_optimizer_params(optimizer, before, model)
    stepping.optimizers.add(optimizer)
    return model, optimizer
