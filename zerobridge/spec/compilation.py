"""Whether and how the model runs under ``torch.compile``.

    >>> from zerobridge.spec.compilation import CompileSpec
    >>> CompileSpec(enabled=True, mode="max-autotune-no-cudagraphs").kwargs()
    {'backend': 'inductor', 'mode': 'max-autotune-no-cudagraphs', 'fullgraph': False, 'dynamic': None}

Every engine keeps its gathers, reductions and hooks outside the compiled
graphs; what the scope chooses is which forwards become graphs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import field_validator

from zerobridge.spec.base import SpecModel

__all__ = ["CompileMode", "CompileScope", "CompileSpec"]


class CompileScope(StrEnum):
    """Which forwards are handed to ``torch.compile``."""

    UNITS = "units"
    """Each wrap unit that holds no other unit is compiled on its own
    (torchtitan's per-block compile, Accelerate's regional compilation); with
    one unit, the whole model. The rest of the model runs eagerly between the
    graphs."""
    MODEL = "model"
    """The whole model, as ``torch.compile(model)`` does (HF Trainer
    ``torch_compile``, DeepSpeed ``engine.compile()``). Graphs end at every
    unit's hooks, so a unit's body is still a graph of its own; a parent
    whose forward calls units inside a loop runs eagerly."""


class CompileMode(StrEnum):
    """``torch.compile``'s ``mode``."""

    DEFAULT = "default"
    """Balanced compile time and speed."""
    REDUCE_OVERHEAD = "reduce-overhead"
    """CUDA graphs where possible (GPU only; kernels otherwise as ``default``)."""
    MAX_AUTOTUNE = "max-autotune"
    """Autotuned kernels plus CUDA graphs: slow to compile."""
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"
    """Autotuned kernels without CUDA graphs."""


class CompileSpec(SpecModel):
    """``torch.compile`` settings, applied by every backend."""

    enabled: bool = False
    """Compile the model (``zerobridge.prepare(..., compile=True)`` and
    ``zerobridge run --compile`` switch it on)."""
    backend: str = "inductor"
    """The ``torch.compile`` backend (``torch._dynamo.list_backends()``:
    ``inductor``, ``aot_eager``, ``eager``, ...)."""
    mode: CompileMode = CompileMode.DEFAULT
    """Inductor's optimization mode."""
    scope: CompileScope = CompileScope.UNITS
    """Compile unit by unit, or the whole model."""
    fullgraph: bool = False
    """Refuse graph breaks inside a compiled forward instead of splitting it
    (with ``scope: units`` a unit's forward must then be one graph)."""
    dynamic: bool | None = None
    """Dynamic shapes: ``None`` lets torch decide after a shape changes,
    ``False`` recompiles per shape, ``True`` compiles shape-generic code at once."""

    @field_validator("backend")
    @classmethod
    def _backend_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("compile.backend is empty: name a torch.compile backend such as 'inductor'")
        return value.strip()

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile``."""
        return {"backend": self.backend, "mode": self.mode.value, "fullgraph": self.fullgraph,
                "dynamic": self.dynamic}
