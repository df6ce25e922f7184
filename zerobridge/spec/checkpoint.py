"""What a saved checkpoint holds, and activation recomputation."""

from __future__ import annotations

from enum import StrEnum

from zerobridge.spec.base import Auto, SpecModel

__all__ = ["CheckpointFormat", "CheckpointSpec"]


class CheckpointFormat(StrEnum):
    """Layout of saved model (and optimizer) state."""

    SHARDED = "sharded"
    """Each rank writes its own shards (DeepSpeed ZeRO checkpoint, FSDP
    SHARDED_STATE_DICT / DCP); reloadable at another world size only through
    a conversion."""
    FULL = "full"
    """One unsharded state dict under the original names, in the master dtype
    (FSDP FULL_STATE_DICT)."""
    CONSOLIDATED_16BIT = "consolidated_16bit"
    """Sharded training state plus one consolidated 16-bit copy of the weights
    (DeepSpeed ``stage3_gather_16bit_weights_on_model_save``)."""


class CheckpointSpec(SpecModel):
    """Checkpoint layout and activation checkpointing."""

    format: CheckpointFormat | Auto = CheckpointFormat.SHARDED
    """What ``save`` writes; ``auto``: the launcher decides (Accelerate:
    ``sharded``)."""
    activation_checkpointing: bool = False
    """Recompute each wrap unit's activations in backward instead of keeping
    them."""
