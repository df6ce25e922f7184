"""ZeRO stages as data: which model states each stage shards.

The stage number is a name for a row of ``STAGE_SHARDS``; nothing dispatches on
it by subclassing. ``ParamSharding`` adds what the stage number cannot say:
*when* sharded parameters are gathered, which is where ZeRO-3, FSDP
FULL_SHARD and SHARD_GRAD_OP differ.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NamedTuple

__all__ = ["STAGE_SHARDS", "ParamSharding", "Stage", "StageShards"]


class Stage(IntEnum):
    """ZeRO stage: the largest set of model states that is sharded."""

    NONE = 0
    """Nothing sharded: data parallel with an all-reduce of the gradients."""
    OPTIMIZER = 1
    """Optimizer state (and fp32 master weights) sharded."""
    GRADIENTS = 2
    """Optimizer state and reduced gradients sharded."""
    PARAMETERS = 3
    """Optimizer state, gradients and parameters sharded."""


class ParamSharding(StrEnum):
    """Where parameters live between uses, and when they are gathered."""

    REPLICATED = "replicated"
    """Full parameters on every rank at all times; when optimizer state is
    sharded the updated shards are all-gathered after each step (ZeRO-0/1/2,
    FSDP NO_SHARD)."""
    RESHARD_AFTER_BACKWARD = "reshard_after_backward"
    """Sharded at rest; gathered once per step before forward and kept until the
    end of backward (FSDP SHARD_GRAD_OP, FSDP2 ``reshard_after_forward=False``)."""
    RESHARD_AFTER_FORWARD = "reshard_after_forward"
    """Sharded at rest; gathered before every forward and again before every
    backward of each unit, freed after each (ZeRO-3, FSDP FULL_SHARD, FSDP2
    ``reshard_after_forward=True``)."""

    @property
    def sharded_at_rest(self) -> bool:
        """Whether a rank holds only its shard between steps."""
        return self is not ParamSharding.REPLICATED


class StageShards(NamedTuple):
    """One row of the stage table."""

    optimizer_state: bool
    gradients: bool
    parameters: ParamSharding


STAGE_SHARDS: dict[Stage, StageShards] = {
    Stage.NONE: StageShards(False, False, ParamSharding.REPLICATED),
    Stage.OPTIMIZER: StageShards(True, False, ParamSharding.REPLICATED),
    Stage.GRADIENTS: StageShards(True, True, ParamSharding.REPLICATED),
    Stage.PARAMETERS: StageShards(True, True, ParamSharding.RESHARD_AFTER_FORWARD),
}
"""What each ZeRO stage shards, as DeepSpeed defines the stages."""
