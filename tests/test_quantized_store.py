"""Frozen shards kept as int8 codes (engine/quantized_store.py): reads and writes at any offset, in
memory and in a swap file, within the codec's bound; no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerobridge.engine.quantized_store import QuantizedRegion
from zerobridge.engine.swapfile import SwapSpace
from zerobridge.runtime.wire_codecs import error_bound, wire_layout

BLOCK = 8


def values(n: int = 45, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_holds_a_quarter_of_fp32_and_reads_any_run_within_the_bound() -> None:
    x = values()
    region = QuantizedRegion.encoding(x, block_size=BLOCK)
    assert region.nbytes == x.numel() + 4 * -(-x.numel() // BLOCK)          # codes, then one fp32 scale per block
    whole = region.read(0, torch.empty(x.numel()))
    bound = error_bound(x, wire_layout("int8", x.numel(), BLOCK))
    assert bool(((whole - x).abs() <= bound).all()) and not torch.equal(whole, x)
    for start, count in [(0, 1), (3, 7), (7, 2), (8, 8), (40, 5), (13, 30)]:   # inside, across and at blocks
        assert torch.equal(region.read(start, torch.empty(count)), whole[start:start + count])
    assert region.read(5, torch.empty(4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(IndexError, match="outside"):
        region.read(40, torch.empty(6))


def test_writes_whole_blocks_as_one_encoding_and_parts_keep_their_neighbours() -> None:
    x, y = values(), values(seed=1)
    region = QuantizedRegion.encoding(x, block_size=BLOCK)
    before = region.read(0, torch.empty(x.numel()))
    region.write(8, y[8:24])                                                 # two whole blocks
    fresh = QuantizedRegion.encoding(y, block_size=BLOCK).read(0, torch.empty(x.numel()))
    after = region.read(0, torch.empty(x.numel()))
    assert torch.equal(after[8:24], fresh[8:24]) and torch.equal(after[:8], before[:8])
    assert torch.equal(after[24:], before[24:])
    # part of a block, away from its largest value: the scale stays, so do the other elements
    start = 24 + (0 if int(after[24:32].abs().argmax()) >= 3 else 5)
    small = after[start:start + 3] / 64
    region.write(start, small)
    again = region.read(0, torch.empty(x.numel()))
    kept = [i for i in range(24, 32) if not start <= i < start + 3]
    assert torch.allclose(again[kept], after[kept], rtol=1e-6, atol=0)
    scale = after[24:32].abs().max() / 127
    assert bool(((again[start:start + 3] - small).abs() <= scale / 2 * (1 + 1e-4)).all())
    # a part that lowers the block's largest value: the others round again, within one old step
    region.write(24, torch.zeros(8))
    region.write(24, after[24:32])
    top = int(after[24:32].abs().argmax())
    region.write(24 + top, torch.zeros(1))
    moved = (region.read(24, torch.empty(8)) - after[24:32]).abs()
    others = [i for i in range(8) if i != top]
    assert float(moved[top]) == float(after[24 + top].abs()) and 0 < float(moved[others].max()) <= float(scale)
    decoded = region.read(0, torch.empty(x.numel()))
    region.write(0, decoded)                                                 # decoded values encode to the same codes
    assert torch.equal(region.read(0, torch.empty(x.numel())), decoded)


def test_a_swap_file_holds_the_same_codes(tmp_path: Path) -> None:
    x = values()
    memory = QuantizedRegion.encoding(x, block_size=BLOCK)
    space = SwapSpace(tmp_path, rank=0, label="parameters")
    try:
        stored = space.allocate(memory.nbytes, torch.uint8)
        stored.write(0, memory.codes())
        on_file = QuantizedRegion(stored, x.numel(), BLOCK)
        assert on_file.nbytes == memory.nbytes and torch.equal(on_file.codes(), memory.codes())
        assert torch.equal(on_file.read(3, torch.empty(20)), memory.read(3, torch.empty(20)))
        on_file.write(10, x[10:12] * 0)
        memory.write(10, x[10:12] * 0)
        assert torch.equal(on_file.codes(), memory.codes())
    finally:
        space.close()
