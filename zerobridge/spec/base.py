"""The base every spec model shares, and the small value types the sections use.

Every model is frozen (a spec is read-only data that every layer receives and
none mutates), forbids unknown keys (a typo is an error, not a silent default)
and turns its field docstrings into descriptions, from which ``docs/spec.md``
is generated.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["AUTO", "Auto", "DType", "SpecModel", "is_auto"]

AUTO: Literal["auto"] = "auto"
Auto = Literal["auto"]
"""A value left for the launcher or trainer to fill at run time (HF Trainer,
Accelerate). It is kept as ``"auto"`` through every translation and reported."""


def is_auto(value: object) -> TypeIs[Auto]:
    """True when ``value`` is the run-time placeholder ``"auto"``."""
    return isinstance(value, str) and value == AUTO


class DType(StrEnum):
    """Floating-point formats the spec can name."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def num_bytes(self) -> int:
        """Bytes per element."""
        return 4 if self is DType.FP32 else 2


class SpecModel(BaseModel):
    """Frozen, closed pydantic model with attribute docstrings as descriptions."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )
