"""explain(): model-state bytes per rank and traffic per step, against the ZeRO paper."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from zerobridge.errors import ConfigError
from zerobridge.explain import CommRow, Explanation, explain, format_bytes
from zerobridge.spec import (
    BatchSpec,
    DType,
    OffloadSpec,
    OptimizerOffload,
    ParamOffload,
    PrecisionSpec,
    ShardingSpec,
    StrategySpec,
)

MIXED = PrecisionSpec(param_dtype="bf16", master_dtype="fp32")  # reduce/accumulate default to bf16
FP32 = PrecisionSpec()  # fp32 AdamW: params are stepped directly, no separate master copy

# (bytes per parameter replicated, bytes per parameter divided by N), from the ZeRO paper.
PAPER = {
    "mixed": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}
PRECISIONS = {"mixed": MIXED, "fp32": FP32}
P_75B = 7_500_000_000


def make(stage: int, precision: PrecisionSpec = MIXED, *, offload: OffloadSpec | None = None,
         batch: BatchSpec | None = None, **sharding: object) -> StrategySpec:
    return StrategySpec(
        sharding=ShardingSpec.for_stage(stage, **sharding), precision=precision,
        offload=offload or OffloadSpec(), batch=batch or BatchSpec(),
    )


def row(e: Explanation, purpose: str) -> CommRow:
    (match,) = [c for c in e.comms if c.purpose == purpose]
    return match


# ---- memory ----

@pytest.mark.parametrize("params,world", [(1_024_000_000, 8), (P_75B, 64)])
@pytest.mark.parametrize("kind", ["mixed", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_paper_formulas(stage: int, kind: str, params: int, world: int) -> None:
    e = explain(make(stage, PRECISIONS[kind]), params=params, world_size=world)
    replicated, sharded = PAPER[kind][stage]
    assert e.model_state_bytes == replicated * params + sharded * params // world
    assert e.bytes_per_tier() == {"accelerator": e.model_state_bytes}
    assert e.shard_group_size == world and e.replicas == 1


def test_per_state_breakdown_mixed_stage1() -> None:
    e = explain(make(1), params=1_000_000, world_size=4)
    assert e.bytes_per_state() == {"parameters": 2_000_000, "gradients": 2_000_000, "optimizer_state": 3_000_000}
    assert [(r.name, r.sharded, r.group_size, r.formula) for r in e.states] == [
        ("parameters", False, 1, "2P"), ("gradients", False, 1, "2P"), ("optimizer_state", True, 4, "12P/N")]
    assert e.formula == "4P + 12P/N"


def test_gathered_layout_counts_the_fp32_shard_as_the_master() -> None:
    """FSDP's layout at stage 3 with fp32 gradients: 4P/N parameters (the master), 4P/N
    gradients, 8P/N moments; DeepSpeed's stores 2 + 2 + 12 with 16-bit gradients."""
    fsdp = PrecisionSpec(param_dtype="bf16", master_dtype="fp32", reduce_dtype="fp32", accumulate_dtype="fp32",
                         compute_copy="gathered")
    e = explain(make(3, fsdp), params=1_000_000, world_size=4)
    assert e.bytes_per_state() == {"parameters": 1_000_000, "gradients": 1_000_000, "optimizer_state": 2_000_000}
    assert e.formula == "16P/N"
    assert any("only while it is gathered" in n for n in e.notes)
    stored = explain(make(3), params=1_000_000, world_size=4)
    assert stored.bytes_per_state() == {"parameters": 500_000, "gradients": 500_000, "optimizer_state": 3_000_000}
    assert any("cast to fp32 for the optimizer at the step" in n for n in stored.notes)
    replicated = explain(make(1, fsdp), params=1_000_000, world_size=4)  # the engine stores it there
    assert replicated.bytes_per_state()["parameters"] == 2_000_000
    assert any("parameters are replicated at rest" in n for n in replicated.notes)


@pytest.mark.parametrize("stage,expected,text,formula", [
    (0, 120_000_000_000, "120 GB", "16P"),
    (1, 31_406_250_000, "31.4 GB", "4P + 12P/N"),
    (2, 16_640_625_000, "16.6 GB", "2P + 14P/N"),
    (3, 1_875_000_000, "1.88 GB", "16P/N"),
])
def test_headline_75b_on_64(stage: int, expected: int, text: str, formula: str) -> None:
    e = explain(make(stage), params=P_75B, world_size=64)
    assert e.model_state_bytes == expected
    assert format_bytes(e.model_state_bytes) == text
    assert e.formula == formula


def test_sgd_has_one_moment() -> None:
    assert explain(make(0), params=1000, world_size=2, optimizer="sgd").model_state_bytes == 12_000
    assert explain(make(0, FP32), params=1000, world_size=2, optimizer="sgd").model_state_bytes == 12_000
    assert explain(make(3, FP32), params=1000, world_size=2, optimizer="sgd").model_state_bytes == 6_000


def test_odd_params_are_padded_to_the_group() -> None:
    e = explain(make(3), params=1001, world_size=4)  # each rank holds ceil(1001/4) = 251 elements
    assert e.model_state_bytes == 16 * 251


def test_odd_params_pad_the_collectives_too() -> None:
    e = explain(make(3), params=1001, world_size=4)
    assert [c.payload_bytes for c in e.comms] == [2 * 1004] * 3
    assert [c.bus_bytes_per_rank for c in e.comms] == [2 * 753] * 3


def test_auto_dtype_resolves_and_is_noted() -> None:
    spec = make(1, PrecisionSpec(param_dtype="auto", master_dtype="fp32"))
    bf16 = explain(spec, params=1_000_000, world_size=4)
    assert bf16.model_state_bytes == 4_000_000 + 3_000_000  # mixed: 4P + 12P/N
    assert any("param_dtype is 'auto'" in n and "bf16" in n for n in bf16.notes)
    fp32 = explain(spec, params=1_000_000, world_size=4, auto_dtype=DType.FP32)
    assert fp32.model_state_bytes == 8_000_000 + 2_000_000  # fp32: 8P + 8P/N


# ---- offload ----

def test_optimizer_offload_moves_grads_and_optimizer_to_cpu() -> None:
    p, n = 1_024_000_000, 8
    base = explain(make(3), params=p, world_size=n)
    off = explain(make(3, offload=OffloadSpec(optimizer=OptimizerOffload(device="cpu"))), params=p, world_size=n)
    assert off.model_state_bytes == base.model_state_bytes == 16 * p // n
    assert off.bytes_per_tier() == {"accelerator": 2 * p // n, "cpu": 14 * p // n}


def test_stage2_offload_keeps_replicated_params_on_accelerator() -> None:
    p, n = 1_024_000_000, 8
    off = explain(make(2, offload=OffloadSpec(optimizer=OptimizerOffload(device="cpu"))), params=p, world_size=n)
    assert off.bytes_per_tier() == {"accelerator": 2 * p, "cpu": 14 * p // n}


def test_stage1_offload_keeps_full_gradients_on_accelerator() -> None:
    p, n = 1_024_000_000, 8
    off = explain(make(1, offload=OffloadSpec(optimizer=OptimizerOffload(device="cpu"))), params=p, world_size=n)
    assert off.bytes_per_tier() == {"accelerator": 4 * p, "cpu": 12 * p // n}


def test_param_and_optimizer_offload_to_nvme() -> None:
    p, n = 1_024_000_000, 8
    offload = OffloadSpec(optimizer=OptimizerOffload(device="nvme", nvme_path="/nvme"),
                          parameters=ParamOffload(device="cpu"))
    e = explain(make(3, offload=offload), params=p, world_size=n)
    assert e.bytes_per_tier() == {"cpu": 2 * p // n, "nvme": 14 * p // n}
    assert e.model_state_bytes == 16 * p // n


def test_partial_optimizer_offload_splits_by_ratio() -> None:
    p, n = 1_024_000_000, 8
    offload = OffloadSpec(optimizer=OptimizerOffload(device="cpu", ratio=0.25))
    e = explain(make(3, offload=offload), params=p, world_size=n)
    assert e.bytes_per_tier() == {"accelerator": 2 * p // n + 14 * p // n * 3 // 4, "cpu": 14 * p // n // 4}
    assert e.model_state_bytes == 16 * p // n
    assert e.bytes_per_state()["optimizer_state"] == 12 * p // n


# ---- communication ----

@pytest.mark.parametrize("kind", ["mixed", "fp32"])
@pytest.mark.parametrize("stage,elements", [(1, 2), (2, 2), (3, 3)])
def test_payload_per_step_is_2p_or_3p(stage: int, elements: int, kind: str) -> None:
    p, n = 1_024_000_000, 8
    e = explain(make(stage, PRECISIONS[kind]), params=p, world_size=n)
    width = 2 if kind == "mixed" else 4
    assert all(c.count_per_step == 1 for c in e.comms)
    assert sum(c.payload_bytes for c in e.comms) == elements * p * width
    assert sum(c.bus_bytes_per_rank * c.group_size // (c.group_size - 1) for c in e.comms) == elements * p * width


def test_stage0_all_reduce_moves_2p() -> None:
    p, n = 1_024_000_000, 8
    (c,) = explain(make(0), params=p, world_size=n).comms
    assert (c.collective, c.group_size, c.payload_bytes) == ("all-reduce", n, 2 * p)
    assert c.bus_bytes_per_rank * n // (n - 1) == 2 * (2 * p)


def test_bus_volume_convention_small_numbers() -> None:
    e = explain(make(2, FP32), params=1000, world_size=4)
    assert [(c.collective, c.payload_bytes, c.bus_bytes_per_rank) for c in e.comms] == [
        ("reduce-scatter", 4000, 3000), ("all-gather", 4000, 3000)]
    assert e.comm_bytes_per_step == 6000


def test_world_of_one_moves_nothing() -> None:
    e = explain(make(3), params=1000, world_size=1)
    assert e.comm_bytes_per_step == 0 and e.model_state_bytes == 16_000


def test_hybrid_shards_inside_group_and_all_reduces_across() -> None:
    p = 1_024_000_000
    e = explain(make(3, shard_group="node"), params=p, world_size=64, local_world_size=8)
    assert (e.shard_group_size, e.replicas) == (8, 8)
    assert e.model_state_bytes == 16 * p // 8
    ar = row(e, "gradient shard across replicas")
    assert (ar.collective, ar.group_size, ar.payload_bytes) == ("all-reduce", 8, 2 * p // 8)
    assert ar.bus_bytes_per_rank == 2 * (2 * p // 8) * 7 // 8
    assert row(e, "gradients").group_size == 8
    flat = explain(make(3), params=p, world_size=64)
    assert [c.collective for c in flat.comms].count("all-reduce") == 0


def test_hpz_adds_secondary_copy_and_shrinks_backward_gather() -> None:
    p, world = 1_024_000_000, 64
    plain = explain(make(3), params=p, world_size=world)
    hpz = explain(make(3, backward_gather_group="node"), params=p, world_size=world, local_world_size=8)
    assert hpz.bytes_per_state()["secondary_parameters"] == 2 * p // 8
    assert hpz.model_state_bytes == 16 * p // world + 2 * p // 8
    assert hpz.formula == "16P/N + 2P/k"
    assert row(hpz, "parameters for forward").group_size == world
    back = row(hpz, "parameters for backward (hpZ)")
    assert (back.group_size, back.payload_bytes, back.bus_bytes_per_rank) == (8, 2 * p, 2 * p * 7 // 8)
    assert plain.comm_bytes_per_step - hpz.comm_bytes_per_step == 2 * p * 63 // 64 - 2 * p * 7 // 8


def test_hpz_group_must_divide_shard_group() -> None:
    # Fixed numbers are refused by the spec itself; a "node" group is only
    # known once explain resolves it.
    with pytest.raises(ValidationError, match="does not divide shard_group"):
        make(3, shard_group=8, backward_gather_group=16)
    with pytest.raises(ConfigError, match="backward gather group"):
        explain(make(3, shard_group="node", backward_gather_group=16), params=1000, world_size=64,
                local_world_size=8)


def test_shard_grad_op_moves_2p_but_rests_at_16p_over_n() -> None:
    p, n = 1_024_000_000, 8
    spec = StrategySpec(sharding=ShardingSpec.for_stage(3, parameters="reshard_after_backward"), precision=MIXED)
    e = explain(spec, params=p, world_size=n)
    assert e.model_state_bytes == 16 * p // n
    assert sum(c.payload_bytes for c in e.comms) == 2 * (2 * p)
    assert [c.purpose for c in e.comms] == ["gradients", "parameters for forward+backward"]
    accum = StrategySpec(sharding=spec.sharding, precision=MIXED, batch=BatchSpec(accumulation_steps=4))
    assert row(explain(accum, params=p, world_size=n), "parameters for forward+backward").count_per_step == 4


@pytest.mark.parametrize("sync,grad_count", [("every_micro_step", 4), ("accumulation_boundary", 1)])
def test_accumulation_multiplies_gradient_traffic_only_every_micro_step(sync: str, grad_count: int) -> None:
    p, n = 1_024_000_000, 8
    e = explain(make(2, batch=BatchSpec(accumulation_steps=4, grad_sync=sync)), params=p, world_size=n)
    assert row(e, "gradients").count_per_step == grad_count
    assert row(e, "updated parameters after step").count_per_step == 1
    assert e.comm_bytes_per_step == (grad_count + 1) * 2 * p * 7 // 8


def test_stage3_gathers_every_micro_step() -> None:
    e = explain(make(3, batch=BatchSpec(accumulation_steps=4, grad_sync="accumulation_boundary")),
                params=1000, world_size=4)
    assert [(c.purpose, c.count_per_step) for c in e.comms] == [
        ("gradients", 1), ("parameters for forward", 4), ("parameters for backward", 4)]


def test_auto_accumulation_counts_one() -> None:
    e = explain(make(2, batch=BatchSpec(accumulation_steps="auto")), params=1000, world_size=4)
    assert e.accumulation_steps == 1 and row(e, "gradients").count_per_step == 1
    assert any("accumulation_steps is 'auto'" in n for n in e.notes)


# ---- errors ----

@pytest.mark.parametrize("kwargs,sharding,match", [
    ({"world_size": 60}, {"shard_group": 8}, "does not divide the world size 60"),
    ({"world_size": 64}, {"shard_group": 128}, "does not divide the world size 64"),
    ({"world_size": 64}, {"world_size": 32}, "fixes the world size to 32"),
    ({"world_size": 0}, {}, "positive"),
    ({"world_size": 8, "local_world_size": 16}, {}, "local_world_size"),
])
def test_bad_world_size_raises(kwargs: dict, sharding: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        explain(make(3, **sharding), params=1000, **kwargs)


def test_world_size_error_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        explain(make(3, shard_group=8), params=1000, world_size=60)
    assert info.value.key == "sharding.shard_group" and info.value.fix and "multiple of 8" in info.value.fix


# ---- output ----

def test_render_has_the_key_numbers() -> None:
    text = explain(make(3), params=P_75B, world_size=64).render()
    for needle in ("stage 3", "7,500,000,000", "N=64", "1.88 GB", "16P/N", "2P/N", "12P/N", "accelerator",
                   "reduce-scatter", "all-gather", "15.0 GB", "234 MB"):
        assert needle in text, needle


def test_to_json_round_trips_through_json() -> None:
    e = explain(make(2, offload=OffloadSpec(optimizer=OptimizerOffload(device="cpu"))), params=1000, world_size=4)
    data = json.loads(json.dumps(e.to_json()))
    assert data["model_state_bytes"] == e.model_state_bytes == 2000 + 14 * 250
    assert data["bytes_per_tier"] == {"accelerator": 2000, "cpu": 3500}
    assert data["states"][0]["name"] == "parameters" and data["comms"][0]["collective"] == "reduce-scatter"
    assert data["comm_bytes_per_step"] == 2 * 1500


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (512, "512 B"), (1000, "1.00 KB"), (999_999, "1.00 MB"), (2_000_000_000, "2.00 GB"),
    (1_875_000_000, "1.88 GB"), (120_000_000_000, "120 GB"), (1_500_000_000_000, "1.50 TB"),
])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_explain_does_not_import_torch() -> None:
    code = "import sys, zerobridge.explain; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
