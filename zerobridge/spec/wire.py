"""How each collective's payload travels: full precision, or quantized on the wire.

    >>> from zerobridge.spec.wire import WireFormat, WireSpec
    >>> qwz = WireSpec(param_gather=WireFormat.INT8)             # DeepSpeed ZeRO++ qwZ
    >>> qwz.quantized, qwz.param_gather.bytes_per_element
    (True, 1.0)
    >>> from zerobridge.spec.wire import wire_bytes
    >>> [wire_bytes(f, 4096, 2048) for f in (WireFormat.INT8, WireFormat.INT4, WireFormat.FP8)]
    [4104, 2056, 4100]
    >>> WireSpec(param_gather="int4")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for WireSpec
      Value error, wire.param_gather='int4': int4 is a gradient format (ZeRO++ qgZ); parameters travel as ...

Three payloads can be quantized, each on its own:

- ``param_gather``: the parameter all-gathers of sharded parameters (ZeRO-3 /
  FSDP), forward and backward. Each rank quantizes its shard, the gather
  moves the codes and their scales, and every rank (its own piece included)
  decodes into the gathered buffer, so every rank computes with the same
  values. ``int8``: block-wise symmetric with one fp32 scale per
  ``block_size`` elements (DeepSpeed's qwZ). ``fp8``: float8 e4m3 with one
  fp32 scale per shard (the format of torchao's float8 all-gather for FSDP2,
  which scales per parameter tensor instead).
- ``grad_reduce``: the gradient reduce-scatter (ZeRO-2 and 3). A quantized
  value cannot be summed on the wire, so the reduction becomes all-to-alls:
  each rank quantizes the pieces other ranks own, sends them, and sums what
  it receives in fp32. ``int4`` (DeepSpeed's qgZ) and ``int8``, block-wise.
  Across nodes it runs in two hops (inside each node, then between nodes), so
  only one quantized piece per rank crosses the slow link.
- ``frozen_weights``: parameters that do not train (a LoRA base) stored at
  rest as ``int8`` codes and scales, about a quarter of fp32, decoded at each
  gather (DeepSpeed's ``zero_quantized_nontrainable_weights``).

What a stage cannot use is refused by the spec (``StrategySpec``): a
parameter format needs parameters sharded at rest (ZeRO-3), a gradient
format needs a reduce-scatter (ZeRO-2 or 3).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from zerobridge.spec.base import SpecModel

__all__ = ["WireFormat", "WireSpec", "wire_bytes"]


class WireFormat(StrEnum):
    """The form a payload takes on the wire."""

    FULL = "full"
    """The collective's own dtype: the compute dtype for gathers, ``precision.reduce_dtype`` for reductions."""
    INT8 = "int8"
    """Block-wise symmetric int8: ``round(x / s)`` with ``s = amax(block) / 127``, one fp32 scale per block."""
    INT4 = "int4"
    """Block-wise symmetric int4 (``s = amax(block) / 7``), two values per byte; gradients only."""
    FP8 = "fp8"
    """float8 e4m3 with one fp32 scale per shard (``448 / amax``); parameter gathers only."""

    @property
    def bytes_per_element(self) -> float | None:
        """Bytes a value takes on the wire, scales aside; ``None`` for ``full`` (the dtype's own)."""
        return {WireFormat.FULL: None, WireFormat.INT8: 1.0, WireFormat.INT4: 0.5, WireFormat.FP8: 1.0}[self]


def wire_bytes(fmt: WireFormat, numel: int, block_size: int) -> int:
    """Bytes one piece of ``numel`` elements takes on the wire in ``fmt`` (not ``full``): the
    packed values (int8 and fp8 one byte each, int4 two to a byte), then the fp32 scales (one per
    ``block_size`` elements; fp8 one per piece). ``runtime/wire_codecs.py`` lays pieces out so."""
    if fmt is WireFormat.FULL:
        raise ValueError("'full' travels in the collective's own dtype: its bytes are numel x the dtype's size")
    if fmt is WireFormat.FP8:
        return numel + 4
    blocks = -(-numel // block_size)
    values = numel if fmt is WireFormat.INT8 else -(-numel // 2)
    return values + 4 * blocks


class WireSpec(SpecModel):
    """Which collective payloads are quantized, and how."""

    param_gather: WireFormat = WireFormat.FULL
    """Parameter all-gathers of sharded parameters (forward and backward): ``full``, ``int8`` or ``fp8``."""
    grad_reduce: WireFormat = WireFormat.FULL
    """Gradient reduce-scatters: ``full``, ``int8`` or ``int4`` (as quantized all-to-alls)."""
    frozen_weights: WireFormat = WireFormat.FULL
    """Frozen parameters at rest: ``full`` or ``int8`` (codes and scales, decoded at each gather)."""
    block_size: int = Field(default=2048, ge=2, multiple_of=2)
    """Elements per scale block of int8 parameter gathers and int8 frozen weights (even)."""
    grad_block_size: int = Field(default=128, ge=2, multiple_of=2)
    """Elements per scale block of quantized gradient reductions (even, so int4 pairs fill whole bytes).
    Gradients have heavier tails than weights: one scale per 2048 int4 values rounds most of a block to
    zero (+4% final loss at 300 steps of the 20M GPT, ``bench/quantized.py``); 128 keeps the scales at
    1/16 of int4's bytes."""

    @model_validator(mode="after")
    def _check(self) -> WireSpec:
        if self.param_gather is WireFormat.INT4:
            raise ValueError("wire.param_gather='int4': int4 is a gradient format (ZeRO++ qgZ); parameters "
                             "travel as int8 (qwZ) or fp8 (float8 all-gather)")
        if self.grad_reduce is WireFormat.FP8:
            raise ValueError("wire.grad_reduce='fp8': no gradient reduction travels as float8 here; use int8 "
                             "or int4 (ZeRO++ qgZ)")
        if self.frozen_weights not in (WireFormat.FULL, WireFormat.INT8):
            raise ValueError(f"wire.frozen_weights={self.frozen_weights.value!r}: frozen weights are stored "
                             "'full' or 'int8'")
        return self

    @property
    def quantized(self) -> bool:
        """Whether any payload leaves full precision."""
        return any(f is not WireFormat.FULL for f in (self.param_gather, self.grad_reduce, self.frozen_weights))
