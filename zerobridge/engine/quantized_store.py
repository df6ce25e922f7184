"""Frozen shards kept at rest as int8 codes and block scales (ZeRO++'s quantized non-trainable weights).

    >>> import torch
    >>> from zerobridge.engine.quantized_store import QuantizedRegion
    >>> region = QuantizedRegion.encoding(torch.tensor([127.0, -64.0, 0.5, 254.0]), block_size=2)
    >>> region.nbytes                          # 4 int8 codes and 2 fp32 scales, not 16 bytes of fp32
    12
    >>> region.read(1, torch.empty(3)).tolist()  # 0.5 is under half a step (254 / 127 / 2) of its block
    [-64.0, 0.0, 254.0]

A frozen parameter (a LoRA base) never steps, so its shard need not be kept in
the compute dtype between gathers: ``communication.wire.frozen_weights =
"int8"`` stores it as the wire codec's int8 layout (``runtime/wire_codecs.py``:
one signed byte per element, one fp32 scale per ``block_size`` elements, about
a quarter of fp32, half of bf16). The region is a ``Region`` like a swap-file
region (``swapfile.py``), so everything that reads or writes a shard kept away
from the device works unchanged: a gather reads (decodes) it into the compute
shard for the duration of the gather, state dicts and checkpoints read it,
loading and meta-device materialization write it. Its bytes live where the
parameter tier puts them: the device, host memory or a swap file.

Values round once when a block is written whole (at most half a scale step of
the block's ``amax / 127``). Writing part of a block (loading parameter by
parameter where a block spans two) decodes the block, replaces that part and
encodes it again: when that changes the block's largest magnitude, the
elements written earlier round again to the new scale (at most half a new
step each time); when it does not, they keep their values.
"""

from __future__ import annotations

import torch

from zerobridge.engine.swapfile import HostRegion, Region
from zerobridge.runtime.wire_codecs import WireLayout, decode, encode_into, wire_layout

__all__ = ["QuantizedRegion"]


class QuantizedRegion:
    """``numel`` elements stored as int8 codes then fp32 block scales in a byte region ``store``."""

    def __init__(self, store: Region, numel: int, block_size: int) -> None:
        self.store = store
        """The bytes: a host tensor, a device tensor (``HostRegion`` holds a tensor on any device) or a file."""
        self.layout = wire_layout("int8", numel, block_size)

    @classmethod
    def encoding(cls, values: torch.Tensor, *, block_size: int) -> QuantizedRegion:
        """A region on ``values``' device holding ``values`` (flat, float) encoded."""
        layout = wire_layout("int8", values.numel(), block_size)
        wire = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=values.device)
        encode_into(values.reshape(-1), layout, wire)
        return cls(HostRegion(wire), values.numel(), block_size)

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes and the scales."""
        return self.layout.wire_bytes

    @property
    def numel(self) -> int:
        return self.layout.numel

    def codes(self) -> torch.Tensor:
        """All the bytes (codes, then scales) as one uint8 tensor: a view when they are a tensor."""
        if isinstance(self.store, HostRegion):
            return self.store.tensor
        return self.store.read(0, torch.empty(self.layout.wire_bytes, dtype=torch.uint8))

    def _blocks(self, start: int, count: int) -> tuple[int, int, WireLayout]:
        """The first and last + 1 elements of the whole blocks that cover ``[start, start + count)``,
        with the codec layout of that run."""
        if start < 0 or start + count > self.numel:
            raise IndexError(f"elements [{start}, {start + count}) outside a quantized region of {self.numel}")
        size = self.layout.block_size
        lo = start // size * size
        hi = min(-(-(start + count) // size) * size, self.numel)
        return lo, hi, wire_layout("int8", hi - lo, size)

    def _scales_at(self, lo: int, run: WireLayout) -> int:
        """Byte offset in ``store`` of the scales of ``run``, the blocks from element ``lo``."""
        return self.layout.payload_bytes + run.scale_bytes // run.blocks * (lo // run.block_size)

    def _decoded(self, lo: int, run: WireLayout, device: torch.device) -> torch.Tensor:
        """The blocks from element ``lo`` (``run``'s layout) decoded to fp32."""
        wire = torch.empty(run.wire_bytes, dtype=torch.uint8, device=device)
        self.store.read(lo, wire[:run.payload_bytes])
        self.store.read(self._scales_at(lo, run), wire[run.payload_bytes:])
        return decode(wire, run, torch.empty(run.numel, dtype=torch.float32, device=device))

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Decode elements ``[start, start + out.numel())`` into ``out`` (any float dtype); return it."""
        count = out.numel()
        if count == 0:
            return out
        lo, _, run = self._blocks(start, count)
        out.view(-1).copy_(self._decoded(lo, run, out.device)[start - lo:start - lo + count])
        return out

    def write(self, start: int, values: torch.Tensor) -> None:
        """Store ``values`` (flat, any float dtype) at element ``start``: the blocks they touch are
        encoded again (a block written in part keeps its other elements' decoded values)."""
        flat = values.detach().reshape(-1)
        if flat.numel() == 0:
            return
        lo, hi, run = self._blocks(start, flat.numel())
        if lo == start and hi == start + flat.numel():
            whole = flat
        else:
            whole = self._decoded(lo, run, flat.device)
            whole[start - lo:start - lo + flat.numel()] = flat
        wire = encode_into(whole, run, torch.empty(run.wire_bytes, dtype=torch.uint8, device=flat.device))
        self.store.write(lo, wire[:run.payload_bytes])
        self.store.write(self._scales_at(lo, run), wire[run.payload_bytes:])
