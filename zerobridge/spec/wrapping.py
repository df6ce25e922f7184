"""How the model is cut into units: each unit's parameters are gathered,
reduced and freed together.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from zerobridge.spec.base import Auto, SpecModel

__all__ = ["EveryModuleWrap", "RootWrap", "SizeWrap", "TransformerWrap", "WrapSpec"]


class RootWrap(SpecModel):
    """One unit: the whole model (FSDP with no auto-wrap policy)."""

    policy: Literal["root"] = "root"
    """Discriminator."""


class EveryModuleWrap(SpecModel):
    """Every module that owns parameters is fetched on its own, in execution
    order, with prefetching across modules (DeepSpeed ZeRO-3's scheme)."""

    policy: Literal["every_module"] = "every_module"
    """Discriminator."""
    leaf_classes: tuple[str, ...] = ()
    """Module classes fetched whole, with no hooks inside (DeepSpeed
    ``leaf_module``, e.g. mixture-of-experts blocks)."""


class TransformerWrap(SpecModel):
    """One unit per instance of the named layer classes, plus the root."""

    policy: Literal["transformer"] = "transformer"
    """Discriminator."""
    layer_classes: tuple[str, ...] | Auto = "auto"
    """Class names of the repeated layers; ``auto`` takes the model's
    ``_no_split_modules`` (Hugging Face models)."""


class SizeWrap(SpecModel):
    """A unit wherever a subtree reaches ``min_params`` elements."""

    policy: Literal["size"] = "size"
    """Discriminator."""
    min_params: int = Field(default=100_000_000, ge=1)
    """Smallest unit, in parameter elements."""


WrapSpec = Annotated[RootWrap | EveryModuleWrap | TransformerWrap | SizeWrap, Field(discriminator="policy")]
