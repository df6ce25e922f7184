"""How collectives are batched and overlapped.

Sizes are in elements. DeepSpeed batches collectives into buckets of a given
size; FSDP issues one collective per wrap unit, which is the value
``"per_unit"``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from zerobridge.spec.base import Auto, SpecModel
from zerobridge.spec.wire import WireSpec

__all__ = ["BackwardPrefetch", "Bucket", "CommunicationSpec"]

Bucket = Annotated[int, Field(ge=0)] | Literal["per_unit"] | Auto
"""A bucket size in elements, ``"per_unit"`` (one collective per wrap unit,
FSDP's scheme) or ``"auto"`` (filled at run time from the model's hidden
size, as HF Trainer and Accelerate do)."""


class BackwardPrefetch(StrEnum):
    """When the next unit's backward all-gather is issued."""

    NONE = "none"
    """Not prefetched: gathered when backward reaches the unit."""
    BEFORE_GRAD = "before_grad"
    """Issued before the current unit's gradient computation (most overlap,
    most memory; FSDP BACKWARD_PRE)."""
    AFTER_GRAD = "after_grad"
    """Issued after the current unit's gradient computation (FSDP
    BACKWARD_POST)."""


class CommunicationSpec(SpecModel):
    """Bucketing, overlap and prefetch of the collectives."""

    reduce_bucket: Bucket = 500_000_000
    """Gradient elements reduced per collective."""
    allgather_bucket: Bucket = 500_000_000
    """Parameter elements all-gathered per collective after the step when
    parameters are replicated and optimizer state sharded (ZeRO-1/2)."""
    prefetch_bucket: Bucket = 50_000_000
    """Most parameter elements gathered ahead of use when parameters are
    sharded (ZeRO-3 ``stage3_prefetch_bucket_size``)."""
    overlap_reduce: bool = True
    """Reduce gradients while backward still runs, bucket by bucket."""
    forward_prefetch: bool = False
    """Issue the next unit's forward all-gather before the current forward
    runs."""
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.BEFORE_GRAD
    """When the next unit's backward all-gather is issued."""
    max_live_parameters: int | None = Field(default=None, ge=0)
    """Most gathered parameter elements resident at once; ``None``: no bound."""
    max_reuse_distance: int | None = Field(default=None, ge=0)
    """Keep a gathered parameter if it is used again within this many
    elements; ``None``: no such reuse (freed after each use)."""
    max_inflight_gathers: int | None = Field(default=None, ge=1)
    """Most units whose all-gathers are in flight at once (FSDP1
    ``limit_all_gathers``: 2); ``None``: no bound."""
    persistence_threshold: Annotated[int, Field(ge=0)] | Auto = 0
    """Parameters with fewer elements than this are never sharded and stay
    resident on every rank (DeepSpeed ``stage3_param_persistence_threshold``)."""
    model_persistence_threshold: int | None = Field(default=None, ge=0)
    """Most elements kept resident in total by the rule above; ``None``: no
    bound."""
    wire: WireSpec = WireSpec()
    """Which payloads are quantized on the wire (ZeRO++ qwZ/qgZ, float8 all-gather): ``spec/wire.py``."""
