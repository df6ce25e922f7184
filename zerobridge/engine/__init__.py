"""The native engine: ZeRO stages 0-3 and hybrid sharding on torch.distributed.

Layers, each calling only the one below: ``engine`` (module hooks, the step)
-> ``flat_group`` (one unit's tensors) -> ``collectives`` (free functions
over explicit groups). ``plan`` resolves a spec, ``mesh`` builds the groups,
``layout`` and ``units`` are pure arithmetic over the model. ``offload``
places master values, optimizer state and shards on their tiers (swap files
for nvme), ``swap`` streams nvme optimizer state through the step, ``master``
reads and writes master values wherever they live.
"""

from zerobridge.engine.engine import Engine
from zerobridge.engine.plan import EnginePlan, plan_engine

__all__ = ["Engine", "EnginePlan", "plan_engine"]
