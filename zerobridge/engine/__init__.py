"""The native engine: ZeRO stages 0-3 and hybrid sharding on torch.distributed.

Layers, each calling only the one below: ``engine`` (module hooks, the
accumulation window, the step) -> ``schedule`` (which unit is gathered
when), ``reducing`` (buckets in flight) and ``bucket_views`` (the views a
group's buckets show its modules, and when a replicated bucket's are cut)
-> ``flat_group`` (one unit's tensors) -> ``collectives`` (free functions over explicit groups), with
``streams`` (CUDA side streams; no-ops on the CPU). ``plan`` resolves a spec
for the engine on top of the shared run rules (``zerobridge.runtime``),
``mesh`` builds the groups, ``layout`` is pure arithmetic over shards.
``tiers`` places master values, optimizer state and shards on their tiers
(``swapfile`` holds the nvme tier's files), ``nvme_step`` streams nvme
optimizer state through the step, ``master`` reads and writes master values
wherever they live, ``grad_store`` keeps a group's gradients from backward
to the optimizer, ``step`` is the engine's stepper (``NativeStepper``;
``param_range`` steps a parameter larger than its tile a range at a time),
``state`` gathers full state and counts bytes, and ``local_runs`` is what
the rest of zerobridge reads and writes of an engine (checkpoints,
pretrained weights, meta-device values).
"""

from zerobridge.engine.engine import Engine
from zerobridge.engine.plan import EnginePlan, plan_engine

__all__ = ["Engine", "EnginePlan", "plan_engine"]
