"""Low-precision wire formats for collective payloads: encode a flat tensor to bytes, decode it back.

    >>> import torch
    >>> from zerobridge.runtime.wire_codecs import decode, encode, error_bound, wire_layout
    >>> x = torch.tensor([0.5, -1.0, 0.0, 3.0])
    >>> layout = wire_layout("int8", x.numel(), block_size=2)
    >>> wire = encode(x, layout)
    >>> wire.dtype, wire.numel()                        # 4 int8 values, then 2 fp32 scales
    (torch.uint8, 12)
    >>> y = decode(wire, layout, torch.empty(4))
    >>> y
    tensor([ 0.5039, -1.0000,  0.0000,  3.0000])
    >>> bool(((y - x).abs() <= error_bound(x, layout)).all())
    True
    >>> {kind: wire_layout(kind, 4096).wire_bytes for kind in ("int8", "int4", "fp8")}
    {'int8': 4104, 'int4': 2056, 'fp8': 4100}
    >>> 4096 * torch.bfloat16.itemsize                  # "full" sends the bf16 tensor itself
    8192

One rank's piece on the wire is a single flat ``uint8`` tensor: the packed
values (``payload_bytes``), then the fp32 scales viewed as bytes
(``scale_bytes``). Every piece of a collective has the same ``WireLayout``, so
an all-gather of pieces is an all-gather of equal byte buffers, and
``encode_into`` writes a piece straight into its slice of the gather buffer.

``int8``: block-wise symmetric (ZeRO++ qwZ/qgZ style). The flat input is cut
into blocks of ``block_size`` elements (the last one zero-padded for the
arithmetic); each block has the fp32 scale ``amax(|x|) / 127`` and sends
``round(x / scale)`` clamped to [-127, 127]. A block of zeros gets scale 1.
Padding is not sent: the payload is ``numel`` bytes.

``int4``: the same with range [-7, 7] (``scale = amax / 7``), two values per
byte, the element of even index in the low nibble, stored offset-binary
(``q + 8``, so 0 is ``0b1000``; an odd count's last high nibble is a padded 0, ``0b1000``).
``block_size`` must be even; the payload is ``ceil(numel / 2)`` bytes.

``fp8``: ``float8_e4m3fn`` with one fp32 tensor-wise scale ``448 / amax``
(``amax`` 0 gives scale 1; an ``amax`` below ``2**-100`` is raised to it so the
scale stays finite). The values are ``x * scale`` clamped to +-448 and cast;
decoding is ``q.float() / scale``.

Why bytes: gloo refuses float8 tensors (and NCCL's all-gather has no int4),
so every format travels as ``uint8`` and is reinterpreted at each end
(``Tensor.view`` with a dtype: no copy of the values; the few scale bytes are
copied on decode, since a float32 view needs a byte offset divisible by 4).

Everything is vectorized torch on whatever device the input lives on, with no
host sync and no control flow that depends on values, so it also runs on
``FakeTensor``s and under tracing. A block (or, for fp8, a tensor) holding
inf or NaN gets a non-finite scale and decodes to non-finite values, so
overflow checks after the collective still see it. ``error_bound`` is the
guarantee the tests hold each format to, for a decode into a float32 ``out``
(a narrower ``out`` adds its own rounding: half an ulp of its dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["WIRE_KINDS", "WireLayout", "decode", "encode", "encode_into", "error_bound", "wire_layout"]

WIRE_KINDS = ("full", "int8", "int4", "fp8")
"""``full`` is the tensor itself in its own dtype (no codec); the others are the codecs of this module."""

_QMAX = {"int8": 127, "int4": 7}
"""The largest magnitude of a block-wise kind's integers."""

_FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn``."""

_FP8_AMAX_FLOOR = 2.0**-100
"""Smallest ``amax`` the fp8 scale divides by: keeps ``448 / amax`` finite for subnormal inputs."""

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INT_SLACK = 2.0**-15
"""Extra bound, in units of the scale, for the fp32 rounding of ``x / scale`` and ``q * scale`` (|q| <= 127)."""

_FP8_SLACK = 2.0**-16
"""Extra relative bound for the fp32 rounding of ``x * scale`` and ``q / scale``."""

_SCALE_BYTES = 4  # fp32


@dataclass(frozen=True)
class WireLayout:
    """How one rank's piece of ``numel`` elements lies on the wire in format ``kind``."""

    kind: str
    """One of ``WIRE_KINDS``."""
    numel: int
    """Elements of the original flat tensor."""
    block_size: int
    """Elements per scale block (fp8 and full: ``max(numel, 1)``, one block)."""

    def __post_init__(self) -> None:
        if self.kind not in WIRE_KINDS:
            raise ValueError(f"unknown wire kind {self.kind!r}: expected one of {', '.join(WIRE_KINDS)}")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {self.numel!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.kind == "int4" and self.block_size % 2:
            raise ValueError(f"int4 packs two values per byte: block_size must be even, got {self.block_size}")
        if self.kind in ("fp8", "full") and self.block_size != max(self.numel, 1):
            raise ValueError(f"{self.kind} has one block: block_size must be max(numel, 1) = {max(self.numel, 1)}, "
                             f"got {self.block_size} (build layouts with wire_layout)")

    @property
    def blocks(self) -> int:
        """Scale blocks: ``ceil(numel / block_size)`` for int8/int4, 1 for fp8, 0 for full (no scales)."""
        if self.kind == "full":
            return 0
        if self.kind == "fp8":
            return 1
        return -(-self.numel // self.block_size)

    @property
    def padded_numel(self) -> int:
        """Elements the block arithmetic works on: whole blocks (``numel`` for fp8 and full)."""
        if self.kind in _QMAX:
            return self.blocks * self.block_size
        return self.numel

    @property
    def payload_bytes(self) -> int:
        """Bytes of the packed values: ``numel`` (int8, fp8) or ``ceil(numel / 2)`` (int4).

        ``full`` has no fixed byte count (it is the tensor in its own dtype): a ValueError."""
        if self.kind == "full":
            raise ValueError('"full" travels as the tensor itself: its bytes are numel * its dtype\'s itemsize')
        if self.kind == "int4":
            return (self.numel + 1) // 2
        return self.numel

    @property
    def scale_bytes(self) -> int:
        """Bytes of the fp32 scales: 4 per block (fp8: 4)."""
        return _SCALE_BYTES * self.blocks

    @property
    def wire_bytes(self) -> int:
        """``payload_bytes + scale_bytes``: what one rank's piece puts on the wire."""
        return self.payload_bytes + self.scale_bytes


def wire_layout(kind: str, numel: int, block_size: int = 2048) -> WireLayout:
    """The layout of a ``numel``-element piece in format ``kind``; fp8 and full ignore ``block_size``
    (beyond checking it is >= 1): they have one block of the whole tensor."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if kind in ("fp8", "full") and isinstance(numel, int):
        block_size = max(numel, 1)
    return WireLayout(kind, numel, block_size)


def _codec(layout: WireLayout) -> str:
    if layout.kind == "full":
        raise ValueError('"full" travels as the tensor itself: encode and decode take the kinds int8, int4, fp8')
    return layout.kind


def _flat_input(x: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """``x`` flat in fp32, after checking its dtype and element count."""
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"expected a float32, bfloat16 or float16 tensor to encode, got {x.dtype}")
    if x.numel() != layout.numel:
        raise ValueError(f"expected {layout.numel} elements (the layout's numel), got {x.numel()}")
    return x.reshape(-1).to(torch.float32)


def _block_scales(padded: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """The fp32 scale of each block of ``padded`` (whole blocks): ``amax / qmax``, 1 where that is 0."""
    amax = padded.view(layout.blocks, layout.block_size).abs().amax(dim=1)
    scales = amax / _QMAX[layout.kind]
    # 0 for a block of zeros (or an amax that underflows): 1 decodes to the same zeros. NaN and inf stay.
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def _fp8_scale(flat: torch.Tensor) -> torch.Tensor:
    """The fp32 scalar ``448 / amax`` (1 where amax is 0)."""
    if flat.numel() == 0:  # a static shape, not a value: amax of nothing is 0
        return torch.ones((), dtype=torch.float32, device=flat.device)
    amax = flat.abs().amax()
    scale = _FP8_MAX / amax.clamp(min=_FP8_AMAX_FLOOR)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _pad(flat: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    return F.pad(flat, (0, layout.padded_numel - layout.numel))


def encode_into(x: torch.Tensor, layout: WireLayout, out_uint8: torch.Tensor) -> torch.Tensor:
    """Encode ``x`` (``layout.numel`` elements, float32/bfloat16/float16) into ``out_uint8``, a flat uint8
    tensor of ``layout.wire_bytes`` elements (a slice of a bigger buffer is fine); return ``out_uint8``."""
    kind = _codec(layout)
    if out_uint8.dtype != torch.uint8 or out_uint8.dim() != 1 or out_uint8.numel() != layout.wire_bytes:
        raise ValueError(f"expected a flat uint8 tensor of {layout.wire_bytes} elements (layout.wire_bytes) "
                         f"to encode into, got {out_uint8.dtype} of shape {tuple(out_uint8.shape)}")
    flat = _flat_input(x, layout)
    payload = out_uint8[: layout.payload_bytes]
    if kind == "fp8":
        scale = _fp8_scale(flat)
        q = (flat * scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        payload.copy_(q.view(torch.uint8))
        out_uint8[layout.payload_bytes :].copy_(scale.reshape(1).view(torch.uint8))
        return out_uint8
    padded = _pad(flat, layout)
    scales = _block_scales(padded, layout)
    qmax = _QMAX[kind]
    ratio = padded.view(layout.blocks, layout.block_size) / scales.unsqueeze(1)
    # NaN (a block holding NaN or inf) has no integer: 0, the block's non-finite scale carries it.
    q = torch.nan_to_num(ratio.round(), nan=0.0).clamp(-qmax, qmax).reshape(-1)
    if kind == "int8":
        payload.copy_(q[: layout.numel].to(torch.int8).view(torch.uint8))
    else:
        nibbles = (q[: 2 * layout.payload_bytes] + 8).to(torch.int32).view(-1, 2)
        payload.copy_((nibbles[:, 0] + nibbles[:, 1] * 16).to(torch.uint8))
    out_uint8[layout.payload_bytes :].copy_(scales.view(torch.uint8))
    return out_uint8


def encode(x: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """One flat uint8 tensor of layout.wire_bytes bytes: packed values then the fp32 scales viewed as bytes."""
    _codec(layout)
    out = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=x.device)
    return encode_into(x, layout, out)


def decode(wire: torch.Tensor, layout: WireLayout, out: torch.Tensor) -> torch.Tensor:
    """Write the decoded values (first layout.numel) into `out` (any float dtype, flat, numel elements); return out."""
    kind = _codec(layout)
    if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != layout.wire_bytes:
        raise ValueError(f"expected a flat uint8 wire tensor of {layout.wire_bytes} elements (layout.wire_bytes), "
                         f"got {wire.dtype} of shape {tuple(wire.shape)}")
    if not out.is_floating_point() or out.dim() != 1 or out.numel() != layout.numel:
        raise ValueError(f"expected a flat floating-point out of {layout.numel} elements (layout.numel), "
                         f"got {out.dtype} of shape {tuple(out.shape)}")
    payload = wire[: layout.payload_bytes]
    # A copy: the scales start at any byte offset, and a float32 view needs one divisible by 4.
    scales = wire[layout.payload_bytes :].clone().view(torch.float32)
    if kind == "fp8":
        out.copy_(payload.view(torch.float8_e4m3fn).to(torch.float32) / scales.reshape(()))
        return out
    if kind == "int8":
        q = payload.view(torch.int8).to(torch.float32)
    else:
        packed = payload.to(torch.int32)
        pairs = torch.stack((packed & 15, packed >> 4), dim=1).reshape(-1)
        q = (pairs[: layout.numel] - 8).to(torch.float32)
    blocks = _pad(q, layout).view(layout.blocks, layout.block_size) * scales.unsqueeze(1)
    out.copy_(blocks.reshape(-1)[: layout.numel])
    return out


def error_bound(x: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """Per-element bound on |decode(encode(x)) - x| for this format (int: scale/2 per block; fp8: relative 2**-4 of
    |x| plus the subnormal floor / scale), as a tensor shaped like x.

    The bound is fp32 and holds for a float32 ``out``; it carries a little slack for the fp32 arithmetic
    (``2**-15`` of a scale for int8/int4, a relative ``2**-16`` for fp8). ``full`` is exact: zeros."""
    flat = _flat_input(x, layout)
    if layout.kind == "full":
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if layout.kind == "fp8":
        scale = _fp8_scale(flat)
        # e4m3 keeps 3 mantissa bits: half an ulp is <= 2**-4 of a normal value; subnormals are 2**-9 apart.
        bound = (flat.abs() * 2.0**-4 + 2.0**-10 / scale) * (1 + _FP8_SLACK)
        return bound.reshape(x.shape)
    scales = _block_scales(_pad(flat, layout), layout) * (0.5 + _INT_SLACK)
    per_element = scales.unsqueeze(1).expand(layout.blocks, layout.block_size).reshape(-1)
    return per_element[: layout.numel].reshape(x.shape)
