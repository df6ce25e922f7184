"""Which flat group each parameter joins.

    >>> from zerobridge.engine.grouping import persistent_params
    >>> persistent_params([10, 500, 20, 30], threshold=100, budget=40)
    {0, 2}

Parameters sharded at rest go to their unit's group (trainable and frozen
apart). Replicated parameters (every parameter at stages 0-2, the persistent
ones at stage 3) go to one engine-wide group per kind, laid out last
registered first so buckets fill in backward order.
"""

from __future__ import annotations

import torch

from zerobridge.engine.flat_group import FlatGroup, GroupPlan
from zerobridge.engine.layout import plan_layout
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.plan import EnginePlan
from zerobridge.engine.tiers import ON_DEVICE, Home, Spaces
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.wrap_units import ParamRef
from zerobridge.spec import ParamSharding, WireFormat

__all__ = ["build_groups", "persistent_params"]


def persistent_params(numels: list[int], *, threshold: int, budget: int | None) -> set[int]:
    """Parameters under ``threshold`` elements, in order, while their total fits ``budget``
    (DeepSpeed's param and model persistence thresholds)."""
    chosen: set[int] = set()
    used = 0
    for i, numel in enumerate(numels):
        if numel < threshold and (budget is None or used + numel <= budget):
            chosen.add(i)
            used += numel
    return chosen


def _group_plan(plan: EnginePlan, *, sharding: ParamSharding, trainable: bool) -> GroupPlan:
    """The group's row; where its tensors live follows the offload tiers. A trainable
    group's master is a separate copy in the optimizer tier when the dtypes differ,
    when its shard is offloaded (the step then never needs the shard in memory) or
    when that tier is host memory apart from the device; a frozen group's master
    (mixed precision only) lives where its shard does, unless the shard is kept as int8
    (``communication.wire.frozen_weights``): then there is none. With ``compute_copy="gathered"``
    a sharded group's shard is its master (``GroupPlan.gathered_copy``)."""
    offload = plan.offload
    shard_at = offload.parameters if sharding.sharded_at_rest else ON_DEVICE
    mixed = plan.master_dtype != plan.compute_dtype
    master_at = offload.optimizer if trainable else shard_at
    # FSDP's layout: the shard is the master, cast at each gather.
    gathered = plan.spec.gathers_compute_copy and sharding.sharded_at_rest
    separate = mixed and not gathered
    if trainable:
        separate = separate or shard_at.home is not Home.DEVICE or master_at.home is Home.HOST
    # A frozen shard kept as int8 is its own (only) copy: no master beside it.
    frozen_wire = plan.wire.frozen_weights if not trainable and sharding.sharded_at_rest else WireFormat.FULL
    if frozen_wire is not WireFormat.FULL:
        separate = False
    return GroupPlan(sharding=sharding, shard_grads=plan.grads_sharded, trainable=trainable,
                     compute_dtype=plan.compute_dtype, master_dtype=plan.master_dtype,
                     reduce_dtype=plan.reduce_dtype, accumulate_dtype=plan.accumulate_dtype,
                     keep_secondary=plan.secondary_size < plan.shard_size, separate_master=separate,
                     master_at=master_at, shard_at=shard_at, pin_memory=offload.pin_memory,
                     gathered_copy=gathered, param_wire=plan.wire.param_gather,
                     grad_wire=plan.wire.grad_reduce, wire_block=plan.wire.block_size,
                     grad_block=plan.wire.grad_block_size,
                     frozen_wire=frozen_wire)


def build_groups(refs: list[ParamRef], owner: list[int], units: int, plan: EnginePlan, mesh: Mesh,
                 stats: CommStats, spaces: Spaces | None, device: torch.device
                 ) -> tuple[list[list[FlatGroup]], list[FlatGroup]]:
    """The groups of each of ``units`` units (by index), and the replicated groups, on ``device``."""
    numels = [r.numel for r in refs]
    persistent = (persistent_params(numels, threshold=plan.persistence_threshold,
                                    budget=plan.model_persistence_threshold)
                  if plan.sharding.sharded_at_rest else set(range(len(refs))))
    per_unit: list[list[FlatGroup]] = [[] for _ in range(units)]
    replicated: list[FlatGroup] = []
    for trainable in (True, False):
        chosen = sorted((r for i, r in enumerate(refs) if i in persistent and r.requires_grad == trainable),
                        key=lambda r: -r.order)
        if chosen:
            shards = mesh.shard_size if trainable and plan.optimizer_sharded else 1
            layout = plan_layout([r.numel for r in chosen], shards=shards,
                                 shard_rank=mesh.shard_rank if shards > 1 else 0,
                                 bucket_cap=plan.reduce_bucket if trainable else None)
            group_plan = _group_plan(plan, sharding=ParamSharding.REPLICATED, trainable=trainable)
            replicated.append(FlatGroup(chosen, layout, group_plan, mesh, stats, spaces, device))
        for unit in range(units):
            mine = [r for i, r in enumerate(refs)
                    if i not in persistent and owner[i] == unit and r.requires_grad == trainable]
            if mine:
                layout = plan_layout([r.numel for r in mine], shards=mesh.shard_size,
                                     shard_rank=mesh.shard_rank, bucket_cap=None)
                group_plan = _group_plan(plan, sharding=plan.sharding, trainable=trainable)
                per_unit[unit].append(FlatGroup(mine, layout, group_plan, mesh, stats, spaces, device))
    return per_unit, replicated
