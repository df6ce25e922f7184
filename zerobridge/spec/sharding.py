"""What is sharded, and over which ranks.

A shard group is the set of ranks that split one copy of the sharded states
between them. ``shard_group="world"`` is plain ZeRO / FSDP. A smaller group of
``k`` ranks, replicated across ``world / k`` groups, is hybrid sharding (MiCS,
FSDP HYBRID_SHARD and _HYBRID_SHARD_ZERO2, an FSDP2 2-D mesh).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from zerobridge.errors import ConfigError
from zerobridge.spec.base import SpecModel
from zerobridge.spec.stage import STAGE_SHARDS, ParamSharding, Stage

__all__ = ["GroupSize", "ShardingSpec"]

GroupSize = Literal["world", "node"] | int
"""A group of ranks: the whole world, the ranks of one node (the launcher's
local world size), or an explicit number of ranks."""


class ShardingSpec(SpecModel):
    """Which model states are sharded, when parameters are gathered, and over
    which group."""

    optimizer_state: bool = False
    """Shard optimizer state, including the master copy of the weights when it
    is kept apart from the compute weights."""
    gradients: bool = False
    """Shard reduced gradients: each rank keeps only the gradient of its shard
    (reduce-scatter instead of all-reduce). Requires ``optimizer_state``."""
    parameters: ParamSharding = ParamSharding.REPLICATED
    """Where parameters live between uses and when they are gathered. Sharding
    parameters requires sharding gradients."""
    shard_group: GroupSize = "world"
    """Ranks that split one copy of the sharded states. Smaller than the world
    means hybrid sharding: shard inside each group, replicate across groups
    (gradients reduce-scattered inside the group, all-reduced across)."""
    backward_gather_group: Literal["node"] | int | None = None
    """ZeRO++ hpZ / FSDP2 integer ``reshard_after_forward``: after forward keep
    a secondary shard over groups of this many ranks, so the backward
    all-gather stays inside that group. ``None`` disables it. Needs parameters
    resharded after forward."""
    world_size: int | None = Field(default=None, ge=1)
    """Data-parallel world size when the source fixes it (Accelerate's
    ``num_processes``, a 2-D mesh, torchtitan's degrees); ``None`` means the
    launcher decides."""

    @model_validator(mode="after")
    def _check(self) -> ShardingSpec:
        if self.gradients and not self.optimizer_state:
            raise ValueError(
                "sharding.gradients=true needs sharding.optimizer_state=true: a rank that "
                "keeps only its gradient shard can only step its optimizer shard"
            )
        if self.parameters.sharded_at_rest and not self.gradients:
            raise ValueError(
                f"sharding.parameters={self.parameters.value!r} needs sharding.gradients=true: "
                "set gradients=true, or parameters='replicated'"
            )
        if isinstance(self.shard_group, int) and self.shard_group < 1:
            raise ValueError("sharding.shard_group must be 'world', 'node' or a positive rank count")
        if self.backward_gather_group is not None:
            if self.parameters is not ParamSharding.RESHARD_AFTER_FORWARD:
                raise ValueError(
                    "sharding.backward_gather_group needs parameters='reshard_after_forward': "
                    "only parameters freed after forward are gathered again in backward"
                )
            if isinstance(self.backward_gather_group, int) and self.backward_gather_group < 1:
                raise ValueError("sharding.backward_gather_group must be 'node' or a positive rank count")
        if (isinstance(self.backward_gather_group, int) and isinstance(self.shard_group, int)
                and self.shard_group % self.backward_gather_group):
            raise ValueError(
                f"sharding.backward_gather_group={self.backward_gather_group} does not divide "
                f"shard_group={self.shard_group}: the secondary shard splits each primary group"
            )
        if self.world_size is not None:
            for name in ("shard_group", "backward_gather_group"):
                size = getattr(self, name)
                if isinstance(size, int) and self.world_size % size:
                    raise ValueError(
                        f"sharding.{name}={size} does not divide the world size {self.world_size}: "
                        f"choose a divisor of {self.world_size}"
                    )
        return self

    @classmethod
    def for_stage(cls, stage: Stage | int, **overrides: object) -> ShardingSpec:
        """The sharding DeepSpeed's ZeRO ``stage`` means, with ``overrides``."""
        row = STAGE_SHARDS[Stage(stage)]
        fields: dict[str, object] = {
            "optimizer_state": row.optimizer_state,
            "gradients": row.gradients,
            "parameters": row.parameters,
        }
        fields.update(overrides)
        return cls.model_validate(fields)

    @property
    def stage(self) -> Stage:
        """The ZeRO stage with the same states sharded at rest.

        FSDP SHARD_GRAD_OP is stage 3 at rest (parameters sharded between
        steps); how it differs from ZeRO-3 is ``parameters``.
        """
        if self.parameters.sharded_at_rest:
            return Stage.PARAMETERS
        if self.gradients:
            return Stage.GRADIENTS
        if self.optimizer_state:
            return Stage.OPTIMIZER
        return Stage.NONE

    @property
    def is_hybrid(self) -> bool:
        """Whether states are sharded inside groups smaller than the world."""
        if self.shard_group == "world":
            return False
        return not (isinstance(self.shard_group, int) and self.shard_group == self.world_size)

    def resolve_group(self, size: GroupSize | None, *, world_size: int, local_world_size: int) -> int:
        """A group size in ranks, given the launcher's world and node sizes."""
        if size is None or size == "world":
            return world_size
        if size == "node":
            return local_world_size
        return int(size)

    def check_world(self, world_size: int) -> None:
        """``ConfigError`` when the spec names a world size and ``world_size`` ranks were launched instead."""
        if self.world_size is not None and self.world_size != world_size:
            raise ConfigError(f"sharding.world_size={self.world_size} but {world_size} ranks were launched",
                              key="sharding.world_size", fix=f"launch {self.world_size} ranks, or drop world_size")
