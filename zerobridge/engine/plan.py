"""Turn a spec into the concrete numbers one engine runs with, or refuse it.

    >>> import torch
    >>> from zerobridge.engine.plan import plan_engine
    >>> from zerobridge.spec import ShardingSpec, StrategySpec
    >>> plan = plan_engine(StrategySpec(sharding=ShardingSpec.for_stage(2)), torch.nn.Linear(4, 4),
    ...                    world_size=4, local_world_size=2)
    >>> plan.shard_size, plan.replicas, plan.compute_dtype
    (4, 1, torch.float32)

Every ``"auto"`` is resolved here (bucket sizes from the model's hidden size,
as Hugging Face's DeepSpeed integration does) and every field the engine
cannot honour is refused with what to change, before any tensor moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerobridge.engine.tiers import OffloadPlan, check_offload, plan_offload
from zerobridge.errors import ConfigError
from zerobridge.runtime.plan import RunPlan, hidden_size, plan_run, run_fields
from zerobridge.spec import BackwardPrefetch, GroupSize, ParamSharding, StrategySpec, WireSpec, is_auto

__all__ = ["EnginePlan", "check_runnable", "plan_engine"]


@dataclass(frozen=True)
class EnginePlan(RunPlan):
    """A spec resolved for one model and world size: the run rules every backend shares
    (``RunPlan``) and the native engine's own numbers."""

    shard_size: int
    """N: ranks that split the sharded states (1 when nothing is sharded)."""
    secondary_size: int
    """hpZ group for backward gathers (``shard_size`` without hpZ)."""
    sharding: ParamSharding
    optimizer_sharded: bool
    grads_sharded: bool
    reduce_bucket: int | None
    """Gradient elements per bucket of the replicated group (``None``: one bucket)."""
    allgather_bucket: int | None
    prefetch_bucket: int | None
    """Most elements gathered ahead of use (0: no prefetch; ``None``: one unit)."""
    persistence_threshold: int
    model_persistence_threshold: int | None
    overlap_reduce: bool
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch
    max_inflight_gathers: int | None
    max_live_parameters: int | None
    max_reuse_distance: int | None
    offload: OffloadPlan = OffloadPlan()
    wire: WireSpec = WireSpec()
    """How payloads travel (``communication.wire``)."""
    """Where master values, optimizer state and parameter shards live (``tiers.py``)."""

    @property
    def replicas(self) -> int:
        """R: copies of each shard (world / N)."""
        return self.world_size // self.shard_size


def _auto_size(value: object, key: str, model: nn.Module, rule: str, factor: float) -> int | None:
    """Resolve one bucket-like size: an int, ``per_unit`` (None) or ``auto``."""
    if value == "per_unit":
        return None
    if is_auto(value):
        hidden = hidden_size(model)
        if hidden is None:
            raise ConfigError(f"{key} is 'auto' and {type(model).__name__} has no config.hidden_size to derive it from",
                              key=key, fix=f"give {key} as a number of elements (auto means {rule})")
        return int(factor * hidden * hidden) if "hidden^2" in rule else int(factor * hidden)
    assert isinstance(value, int)
    return value or None


def _group(value: GroupSize | None, *, world: int, local: int, key: str) -> int:
    size = world if value in (None, "world") else local if value == "node" else int(value)
    if size < 1 or world % size:
        raise ConfigError(f"{key}={value!r} is {size} ranks, which does not divide the world size {world}",
                          key=key, fix=f"choose a divisor of {world}, or launch a multiple of {size} ranks")
    return size


def check_runnable(spec: StrategySpec, *, world_size: int | None = None, local_world_size: int | None = None) -> None:
    """The checks that need no model: ``ConfigError`` if the engine cannot run ``spec``
    on ``world_size`` ranks (``None``: not known yet). Offload paths are checked on
    this machine: each nvme_path must be a directory it can write."""
    check_offload(spec.offload, sharded_at_rest=spec.sharding.parameters.sharded_at_rest)
    if world_size is not None:
        local = local_world_size or world_size
        if spec.sharding.optimizer_state:
            _group(spec.sharding.shard_group, world=world_size, local=local, key="sharding.shard_group")
        if spec.sharding.backward_gather_group is not None:
            _group(spec.sharding.backward_gather_group, world=world_size, local=local,
                   key="sharding.backward_gather_group")


def plan_engine(spec: StrategySpec, model: nn.Module, *, world_size: int, local_world_size: int,
                device: torch.device | None = None) -> EnginePlan:
    """Resolve ``spec`` for ``model`` on ``world_size`` ranks; ``ConfigError`` if it cannot run.

    ``device``: where the model's tensors will live (default: where its first
    parameter is; a meta-device model names the device it materializes on)."""
    run = plan_run(spec, world_size=world_size)
    sharding, comm = spec.sharding, spec.communication
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    offload = plan_offload(spec.offload, sharded_at_rest=sharding.parameters.sharded_at_rest,
                           accelerator=device.type != "cpu")
    shard_size = 1
    if sharding.optimizer_state:
        shard_size = _group(sharding.shard_group, world=world_size, local=local_world_size, key="sharding.shard_group")
    secondary = shard_size
    if sharding.backward_gather_group is not None:
        secondary = _group(sharding.backward_gather_group, world=world_size, local=local_world_size,
                           key="sharding.backward_gather_group")
        if shard_size % secondary:
            raise ConfigError(f"sharding.backward_gather_group is {secondary} ranks, which does not divide the "
                              f"shard group of {shard_size}", key="sharding.backward_gather_group",
                              fix=f"choose a divisor of {shard_size}")
    return EnginePlan(
        **run_fields(run), shard_size=shard_size, secondary_size=secondary,  # type: ignore[arg-type]
        sharding=sharding.parameters, optimizer_sharded=sharding.optimizer_state, grads_sharded=sharding.gradients,
        reduce_bucket=_auto_size(comm.reduce_bucket, "communication.reduce_bucket", model, "hidden^2", 1.0),
        allgather_bucket=_auto_size(comm.allgather_bucket, "communication.allgather_bucket", model, "hidden^2", 1.0),
        prefetch_bucket=0 if comm.prefetch_bucket == 0 else _auto_size(
            comm.prefetch_bucket, "communication.prefetch_bucket", model, "0.9 x hidden^2", 0.9),
        persistence_threshold=_auto_size(comm.persistence_threshold, "communication.persistence_threshold", model,
                                         "10 x hidden", 10.0) or 0,
        model_persistence_threshold=comm.model_persistence_threshold,
        overlap_reduce=comm.overlap_reduce, forward_prefetch=comm.forward_prefetch,
        backward_prefetch=comm.backward_prefetch,
        max_inflight_gathers=comm.max_inflight_gathers, max_live_parameters=comm.max_live_parameters,
        max_reuse_distance=comm.max_reuse_distance, offload=offload, wire=comm.wire)
