"""The wire codecs round-trip what they can represent exactly, stay within their error bound on the rest,
put the promised number of bytes on the wire, and run on fake tensors (shapes only)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerobridge.runtime.wire_codecs import WIRE_KINDS, WireLayout, decode, encode, encode_into, error_bound, wire_layout

CODECS = ("int8", "int4", "fp8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def round_trip(x: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    return decode(encode(x, layout), layout, torch.empty(layout.numel))


def scales_of(wire: torch.Tensor, layout: WireLayout) -> torch.Tensor:
    """The fp32 scales after the payload (copied: a float32 view needs a byte offset divisible by 4)."""
    return wire[layout.payload_bytes :].clone().view(torch.float32)


def block_values(qmax: int, blocks: int, block_size: int, gen: torch.Generator, odd: tuple[float, ...]) -> torch.Tensor:
    """``k * s`` per block: integers ``k`` in [-qmax, qmax] with ``qmax`` reached in every block and ``s`` an
    ``odd`` integer times a power of two, so ``amax / qmax`` is ``s`` exactly."""
    k = torch.randint(-qmax, qmax + 1, (blocks, block_size), generator=gen).float()
    k[:, 0] = qmax * torch.where(torch.rand(blocks, generator=gen) < 0.5, -1.0, 1.0)
    k[0, 1:] = 0  # a block that is all zeros but its first value
    multiple = torch.tensor(odd)[torch.randint(0, len(odd), (blocks,), generator=gen)]
    s = multiple * torch.pow(2.0, torch.randint(-20, 10, (blocks,), generator=gen).float())
    return (k * s.unsqueeze(1)).reshape(-1)


# ----------------------------------------------------------------------------- exact round trips


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_formats_round_trip_their_grid_exactly(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    qmax = {"int8": 127, "int4": 7}[kind]
    odd = (1.0, 3.0, 5.0) if dtype == torch.float32 else (1.0,)  # bf16 holds 8 significant bits: 127 * 2**e
    exact = block_values(qmax, blocks=5, block_size=64, gen=gen, odd=odd)[:-10]  # a partial last block
    x = exact.to(dtype)
    assert torch.equal(x.float(), exact)  # the grid is representable in dtype too
    layout = wire_layout(kind, x.numel(), block_size=64)
    assert torch.equal(round_trip(x, layout), x.float())


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, subnormals and both zeros included."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()]


@pytest.mark.parametrize("power", [-8, 0, 5])
def test_fp8_round_trips_e4m3_values_over_the_scale_exactly(power: int) -> None:
    grid = e4m3_values()
    assert grid.abs().max() == 448 and grid.numel() == 254
    x = grid * 2.0**power  # amax 448 * 2**power: the scale is 2**-power, and x * scale is the grid itself
    layout = wire_layout("fp8", x.numel())
    wire = encode(x, layout)
    assert torch.equal(wire[: layout.payload_bytes].view(torch.float8_e4m3fn).float(), grid)
    assert torch.equal(round_trip(x, layout), x)


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 7, 2049])
def test_zeros_round_trip_exactly(kind: str, numel: int) -> None:
    layout = wire_layout(kind, numel, block_size=64)
    wire = encode(torch.zeros(numel, dtype=torch.bfloat16), layout)
    assert (scales_of(wire, layout) == 1).all()  # never NaN or inf
    assert torch.equal(decode(wire, layout, torch.full((numel,), 9.0)), torch.zeros(numel))


# ----------------------------------------------------------------------------- error bounds


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 2049, 10_000])
@pytest.mark.parametrize("block_size", [64, 2048])
def test_random_input_stays_within_the_bound(kind: str, dtype: torch.dtype, numel: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(numel + block_size)
    x = (torch.randn(numel, generator=gen) * 3).to(dtype)
    layout = wire_layout(kind, numel, block_size)
    err = (round_trip(x, layout) - x.float()).abs()
    bound = error_bound(x, layout)
    assert bound.shape == x.shape and bound.dtype == torch.float32
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("kind", CODECS)
def test_the_bound_is_tight_enough_to_mean_something(kind: str) -> None:
    """The error is not zero, and a bound four times tighter would fail: the checks above can catch a bug."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    layout = wire_layout(kind, x.numel(), block_size=64)
    err = (round_trip(x, layout) - x).abs()
    bound = error_bound(x, layout)
    assert err.max() > 0
    assert (err <= bound).all()
    assert (err > bound / 4).any()


@pytest.mark.parametrize("kind", CODECS)
def test_a_narrower_out_only_adds_its_own_rounding(kind: str) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    layout = wire_layout(kind, x.numel(), block_size=64)
    wire = encode(x, layout)
    full = decode(wire, layout, torch.empty(3000))
    assert torch.equal(decode(wire, layout, torch.empty(3000, dtype=torch.bfloat16)), full.bfloat16())


@pytest.mark.parametrize("kind", CODECS)
def test_non_finite_values_stay_non_finite(kind: str) -> None:
    for bad in (float("inf"), float("nan")):
        x = torch.randn(256, generator=torch.Generator().manual_seed(3))
        x[70] = bad
        layout = wire_layout(kind, x.numel(), block_size=64)
        y = round_trip(x, layout)
        assert not y[64:128].isfinite().any()  # the block holding it (fp8: the whole tensor)
        if kind == "fp8":
            assert not y.isfinite().any()
        else:
            others = torch.ones(256, dtype=torch.bool)
            others[64:128] = False
            assert ((y - x).abs()[others] <= error_bound(x, layout)[others]).all()


@pytest.mark.parametrize("kind", CODECS)
def test_a_subnormal_amax_keeps_the_scale_finite_and_nonzero(kind: str) -> None:
    x = torch.tensor([1e-44, -3e-45, 0.0, 1e-40])  # int8/int4: amax / qmax of the first block underflows to 0
    layout = wire_layout(kind, 4, block_size=2)
    scales = scales_of(encode(x, layout), layout)
    assert scales.isfinite().all() and (scales > 0).all()
    assert ((round_trip(x, layout) - x).abs() <= error_bound(x, layout)).all()


# ----------------------------------------------------------------------------- bytes on the wire


def test_wire_bytes_follow_the_formulas() -> None:
    assert wire_layout("int8", 4096, 2048).wire_bytes == 4096 + 2 * 4
    assert wire_layout("int4", 4096, 2048).wire_bytes == 2048 + 2 * 4
    assert wire_layout("fp8", 4096, 2048).wire_bytes == 4096 + 4
    # padding is arithmetic only: an odd count sends ceil(n / 2) int4 bytes, and one scale per started block
    assert [wire_layout(k, 7, 64).wire_bytes for k in CODECS] == [7 + 4, 4 + 4, 7 + 4]
    assert [wire_layout(k, 2049, 2048).wire_bytes for k in CODECS] == [2049 + 8, 1025 + 8, 2049 + 4]
    layout = wire_layout("int4", 2049, 64)
    assert (layout.blocks, layout.payload_bytes, layout.scale_bytes) == (33, 1025, 33 * 4)
    assert wire_layout("fp8", 10, 3).block_size == 10 and wire_layout("fp8", 0).blocks == 1
    assert wire_layout("full", 4096).blocks == 0


@pytest.mark.parametrize("numel", [4096, 2**20 + 6])
def test_codecs_halve_or_quarter_bf16(numel: int) -> None:
    bf16 = 2 * numel
    assert wire_layout("int8", numel).wire_bytes / bf16 <= 0.52
    assert wire_layout("int4", numel).wire_bytes / bf16 <= 0.27
    assert wire_layout("fp8", numel).wire_bytes / bf16 <= 0.51


@pytest.mark.parametrize("kind", CODECS)
@pytest.mark.parametrize("numel", [0, 7, 2049])
def test_encode_gives_wire_bytes_of_uint8(kind: str, numel: int) -> None:
    layout = wire_layout(kind, numel, block_size=64)
    wire = encode(torch.randn(numel), layout)
    assert wire.dtype == torch.uint8 and wire.shape == (layout.wire_bytes,)


@pytest.mark.parametrize("kind", CODECS)
def test_encode_into_writes_only_its_slice(kind: str) -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5)).bfloat16()
    layout = wire_layout(kind, x.numel(), block_size=64)
    start = 37  # an odd offset: the scales are read back without a misaligned float32 view
    buffer = torch.full((start + layout.wire_bytes + 50,), 0xAB, dtype=torch.uint8)
    piece = buffer[start : start + layout.wire_bytes]
    assert encode_into(x, layout, piece) is piece
    assert (buffer[:start] == 0xAB).all() and (buffer[start + layout.wire_bytes :] == 0xAB).all()
    assert torch.equal(piece, encode(x, layout))
    assert torch.equal(decode(piece, layout, torch.empty(1001)), round_trip(x, layout))


def test_int4_packs_the_low_nibble_first_offset_binary() -> None:
    layout = wire_layout("int4", 3, block_size=4)
    wire = encode(torch.tensor([-7.0, 7.0, 1.0]), layout)  # scale 1: q = -7, 7, 1
    assert wire[:2].tolist() == [(7 + 8) << 4 | (-7 + 8), 8 << 4 | (1 + 8)]
    assert scales_of(wire, layout).tolist() == [1.0]


# ----------------------------------------------------------------------------- fake tensors and devices


@pytest.mark.parametrize("kind", CODECS)
def test_fake_tensors_get_the_right_shapes(kind: str) -> None:
    layout = wire_layout(kind, 2049, block_size=64)
    with FakeTensorMode():
        x = torch.randn(2049, dtype=torch.bfloat16)
        wire = encode(x, layout)
        assert wire.shape == (layout.wire_bytes,) and wire.dtype == torch.uint8
        out = decode(wire, layout, torch.empty(2049, dtype=torch.bfloat16))
        assert out.shape == (2049,) and out.dtype == torch.bfloat16
        bound = error_bound(x, layout)
        assert bound.shape == (2049,) and bound.dtype == torch.float32


@pytest.mark.parametrize("kind", CODECS)
def test_dynamo_traces_a_round_trip_without_a_graph_break(kind: str) -> None:
    """fullgraph=True fails on a host sync or on control flow that reads values."""
    layout = wire_layout(kind, 2049, block_size=64)
    traced = torch.compile(lambda x: decode(encode(x, layout), layout, torch.empty(2049)), fullgraph=True,
                           backend="eager")
    x = torch.randn(2049, generator=torch.Generator().manual_seed(6))
    assert torch.equal(traced(x), round_trip(x, layout))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make test-gpu on a GPU machine)")
@pytest.mark.parametrize("kind", CODECS)
def test_cuda_sends_the_bytes_the_cpu_sends(kind: str) -> None:
    x = torch.randn(10_000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    layout = wire_layout(kind, x.numel(), block_size=64)
    wire = encode(x.cuda(), layout)
    assert wire.is_cuda and torch.equal(wire.cpu(), encode(x, layout))
    out = decode(wire, layout, torch.empty(10_000, device="cuda"))
    assert torch.equal(out.cpu(), round_trip(x, layout))


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(("args", "message"), [
    (("int2", 10), "unknown wire kind 'int2': expected one of full, int8, int4, fp8"),
    (("int8", 10, 0), "block_size must be an int >= 1, got 0"),
    (("fp8", 10, -1), "block_size must be an int >= 1, got -1"),
    (("int4", 10, 63), "int4 packs two values per byte: block_size must be even, got 63"),
    (("int8", -1), "numel must be an int >= 0, got -1"),
])
def test_bad_layouts_say_what_was_expected(args: tuple[str, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wire_layout(*args)


def test_a_hand_built_fp8_layout_must_have_one_block() -> None:
    with pytest.raises(ValueError, match=r"fp8 has one block: block_size must be max\(numel, 1\) = 10"):
        WireLayout("fp8", 10, 2048)


def test_full_travels_as_the_tensor_itself() -> None:
    layout = wire_layout("full", 8)
    assert "full" in WIRE_KINDS
    with pytest.raises(ValueError, match='"full" travels as the tensor itself'):
        encode(torch.ones(8), layout)
    with pytest.raises(ValueError, match='"full" travels as the tensor itself'):
        decode(torch.zeros(8, dtype=torch.uint8), layout, torch.empty(8))
    with pytest.raises(ValueError, match='"full" travels as the tensor itself'):
        layout.wire_bytes  # noqa: B018
    assert torch.equal(error_bound(torch.ones(8), layout), torch.zeros(8))


def test_mismatched_tensors_say_what_was_expected() -> None:
    layout = wire_layout("int8", 100, block_size=64)
    with pytest.raises(ValueError, match=r"expected 100 elements \(the layout's numel\), got 99"):
        encode(torch.ones(99), layout)
    with pytest.raises(ValueError, match="expected a float32, bfloat16 or float16 tensor to encode, got torch.int64"):
        encode(torch.ones(100, dtype=torch.int64), layout)
    with pytest.raises(ValueError, match=r"expected a flat uint8 tensor of 108 elements \(layout.wire_bytes\)"):
        encode_into(torch.ones(100), layout, torch.empty(108, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"expected a flat uint8 wire tensor of 108 elements"):
        decode(torch.empty(107, dtype=torch.uint8), layout, torch.empty(100))
    with pytest.raises(ValueError, match=r"expected a flat floating-point out of 100 elements"):
        decode(encode(torch.ones(100), layout), layout, torch.empty(100, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected 100 elements"):
        error_bound(torch.ones(10), layout)
