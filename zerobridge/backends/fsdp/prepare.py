"""torch FSDP2 as a backend: ``zerobridge.prepare(..., backend="fsdp")``.

    import torch, zerobridge

    model = zerobridge.prepare(model, stage=3, backend="fsdp")        # or ZEROBRIDGE_BACKEND=fsdp
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss = model(batch); loss.backward()
    zerobridge.clip_grad_norm_(model, 1.0)
    optimizer.step(); optimizer.zero_grad()
    zerobridge.stats(model)["approximations"]                        # [] unless allow_approximate=True

The spec goes through the FSDP2 translator (``write_fsdp2``) and its report
is judged by ``assess.py``: what FSDP2 cannot run exactly (ZeRO-1,
ZeRO-2's replicated parameters, offloading one tier alone, NVMe) is refused
with the key and the fix, or with ``allow_approximate=True`` run as the
closest FSDP2 form and listed in ``stats()["approximations"]``. Then
``fully_shard`` runs on each native wrap unit (innermost first, the root
last) over a mesh built here (``[world]``, or ``[replicas, shard]`` for
hybrid sharding and ``[world, 1]`` for stage 0) with the spec's
``MixedPrecisionPolicy`` (fp32 sharded parameters are the master weights) and
``CPUOffloadPolicy``. Accumulation, averaging, clipping and fp16 loss
scaling follow the native engine (``step.py``); checkpoints are
zerobridge's (``checkpoint.py``). docs/backends.md has the whole mapping.

The steps, in order (the order matters where noted): check, start the
process group, resolve the run rules and judge the FSDP2 form, cut units,
broadcast rank 0's values, cast states, activation checkpointing (before
sharding, so it wraps the plain modules), ``fully_shard`` innermost first,
materialize a meta model's shards, compile (after sharding: FSDP2's hooks
stay outside the graphs), then the stepper and its optimizer hooks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zerobridge.backends.base import adopt_class, check_fresh, set_backend, start_run
from zerobridge.backends.fsdp.apply import (
    apply_activation_checkpointing,
    apply_fully_shard,
    broadcast_from_rank0,
    cast_states,
    first_names,
    plan_units,
    replace_optimizer_params,
    shard_group,
)
from zerobridge.backends.fsdp.assess import Assessment, assess, refuse
from zerobridge.backends.fsdp.backend import FsdpBackend, ZeroFsdpModule
from zerobridge.backends.fsdp.kwargs import device_mesh_from_form, fully_shard_kwargs
from zerobridge.backends.fsdp.materialize import materialize_fsdp
from zerobridge.backends.fsdp.step import FsdpStepper
from zerobridge.errors import ConfigError
from zerobridge.runtime import comm_stats
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.compile import apply_compile
from zerobridge.runtime.deferred_init import Replay
from zerobridge.runtime.plan import RunPlan, plan_run
from zerobridge.runtime.step_rules import install_optimizer_hooks
from zerobridge.spec import StrategySpec

__all__ = ["judged", "prepare"]


def _check_model(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    check_fresh(model, optimizer)
    if isinstance(model, FSDPModule):
        raise ConfigError(f"{type(model).__name__} is already sharded by fully_shard", key="model",
                          fix="pass the plain model: zerobridge calls fully_shard itself")


def judged(spec: StrategySpec, *, world_size: int, local_world_size: int) -> tuple[RunPlan, Assessment]:
    """The run rules ``prepare`` resolves for ``spec`` on ``world_size`` ranks, and the FSDP2 form it judges
    (``assess``, with the accumulation the rules resolve); ``ConfigError`` when either refuses the spec.
    The planner keys FSDP2 runs by them (``planning.fsdp_fake_run.fsdp_form``)."""
    plan = plan_run(spec, world_size=world_size)
    return plan, assess(spec, world_size=world_size, local_world_size=local_world_size,
                        accumulation_steps=plan.accumulation_steps)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
            allow_approximate: bool, replay: Replay | None = None, device: torch.device | None = None
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``spec`` on torch FSDP2: shard ``model`` in place; return it, or ``(model, optimizer)``
    with the optimizer's parameters replaced by the sharded ones (groups and hyperparameters kept).
    ``replay``: the model is on the meta device; it is sharded there and each rank's shards are
    materialized on ``device`` with the eager values (``materialize.py``)."""

    _check_model(model, optimizer)
    world, local_world = start_run(model, replay, device)
    plan, assessment = judged(spec, world_size=world, local_world_size=local_world)
    cut = plan_units(model, spec.wrapping)
    approximations = assessment.approximations + cut.merged
    if not allow_approximate:
        refuse(approximations)
    stats = CommStats()
    comm_stats.count_into(stats)
    before = first_names(model)
    device_type = device.type if replay is not None and device is not None else next(model.parameters()).device.type
    mesh = device_mesh_from_form(assessment.form["mesh"], world_size=world, device_type=device_type)
    assert mesh is not None  # start_run initialized the process group
    if replay is None:
        broadcast_from_rank0(model)
    cast_states(model, master=plan.master_dtype, buffers=plan.buffer_dtype)
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model, spec.wrapping)
    apply_fully_shard(model, cut, fully_shard_kwargs(assessment.form, mesh, param_dtype=plan.compute_dtype,
                                                     reduce_dtype=plan.reduce_dtype))
    if replay is not None:
        assert device is not None
        materialize_fsdp(model, replay, device, offloaded=assessment.form["offload_policy"] is not None)
    apply_compile([model, *cut.sharded], spec.compile)
    stepper = FsdpStepper(model, plan, shard_group(mesh))
    install_optimizer_hooks(stepper)
    adopt_class(model, ZeroFsdpModule, "Zero")
    set_backend(model, FsdpBackend(model, plan, mesh, stepper, stats, assessment, approximations))
    stats.reset()
    if optimizer is None:
        return model
    replace_optimizer_params(optimizer, before, model)
    stepper.optimizers.add(optimizer)
    return model, optimizer
