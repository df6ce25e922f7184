"""Engine features beyond the stage table: mixed precision, fp16 loss scaling,
activation checkpointing, prefetch and persistence knobs, the tiny GPT,
ZEROBRIDGE_CONFIG, and a peer that never joins (a timeout, not a hang)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import torch

from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.spec import (
    BackwardPrefetch,
    CheckpointSpec,
    CommunicationSpec,
    DynamicLossScale,
    EveryModuleWrap,
    PrecisionSpec,
    ShardingSpec,
    SizeWrap,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.testing.gpt import reference_gpt
from zerobridge.testing.parity import RunResult, run_reference

pytestmark = pytest.mark.distributed

NATIVE = "zerobridge.testing.parity:run_native"


@pytest.fixture(scope="module")
def pair() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=120) as cluster:
        yield cluster


@cache
def reference(optimizer: str = "adamw") -> RunResult:
    return run_reference(optimizer=optimizer)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_close_run(got: RunResult, ref: RunResult, *, rtol: float, atol: float) -> None:
    assert max(_rel(a, b) for a, b in zip(got.losses, ref.losses)) <= rtol
    assert max(_rel(a, b) for a, b in zip(got.grad_norms, ref.grad_norms)) <= rtol * 10
    for name, value in ref.state.items():
        assert (got.state[name].float() - value).abs().max().item() <= atol, name


def stage3(**fields: Any) -> StrategySpec:
    return StrategySpec(sharding=ShardingSpec.for_stage(3), **fields)


# Knobs that move communication in time but must not change one number.
SCHEDULES: dict[str, StrategySpec] = {
    "activation checkpointing, layer units": stage3(wrapping=TransformerWrap(),
                                                    checkpoint=CheckpointSpec(activation_checkpointing=True)),
    "activation checkpointing, every module": stage3(wrapping=EveryModuleWrap(),
                                                     checkpoint=CheckpointSpec(activation_checkpointing=True)),
    "activation checkpointing at stage 2": StrategySpec(
        sharding=ShardingSpec.for_stage(2), wrapping=TransformerWrap(),
        checkpoint=CheckpointSpec(activation_checkpointing=True)),
    "forward prefetch, backward after grad, 2 in flight": stage3(
        wrapping=EveryModuleWrap(), communication=CommunicationSpec(
            forward_prefetch=True, backward_prefetch=BackwardPrefetch.AFTER_GRAD, max_inflight_gathers=2,
            prefetch_bucket=2000)),
    "no backward prefetch, no overlap": stage3(wrapping=TransformerWrap(), communication=CommunicationSpec(
        backward_prefetch=BackwardPrefetch.NONE, overlap_reduce=False)),
    "persistence threshold 100": stage3(wrapping=TransformerWrap(),
                                        communication=CommunicationSpec(persistence_threshold=100)),
    "reuse distance keeps the last units": stage3(wrapping=TransformerWrap(),
                                                  communication=CommunicationSpec(max_reuse_distance=5000)),
    "size wrap 300": stage3(wrapping=SizeWrap(min_params=300)),
    "small buckets, small gathers": StrategySpec(sharding=ShardingSpec.for_stage(1), communication=CommunicationSpec(
        reduce_bucket=200, allgather_bucket=300)),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_change_no_number(pair: Cluster, name: str) -> None:
    results: Any = pair.run(NATIVE, spec=SCHEDULES[name], optimizer="sgd")
    assert_close_run(results[0], reference("sgd"), rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_compute_with_fp32_master(pair: Cluster, stage: int) -> None:
    spec = StrategySpec(sharding=ShardingSpec.for_stage(stage), wrapping=TransformerWrap(),
                        precision=PrecisionSpec(param_dtype="bf16", master_dtype="fp32", reduce_dtype="fp32"))
    results: Any = pair.run(NATIVE, spec=spec, optimizer="sgd")
    # bf16 keeps 8 bits of mantissa: within bf16 tolerances of the fp32 reference.
    # (SGD: Adam turns bf16 noise in near-zero gradients into lr-sized steps.)
    assert_close_run(results[0], reference("sgd"), rtol=2e-2, atol=2e-2)
    for name, value in results[0].state.items():
        assert value.dtype == torch.float32, f"{name}: full state is in the master dtype"


def test_bf16_stages_agree_with_each_other(pair: Cluster) -> None:
    runs = []
    for stage in (2, 3):
        spec = StrategySpec(sharding=ShardingSpec.for_stage(stage),
                            precision=PrecisionSpec(param_dtype="bf16", master_dtype="fp32"))
        runs.append(pair.run(NATIVE, spec=spec, optimizer="sgd")[0])
    assert max(_rel(a, b) for a, b in zip(runs[0].losses, runs[1].losses)) <= 1e-6  # type: ignore[attr-defined]


@pytest.mark.parametrize("sharding", [
    ShardingSpec.for_stage(3), ShardingSpec.for_stage(3, backward_gather_group=1),
    ShardingSpec.for_stage(3, parameters="reshard_after_backward"), ShardingSpec.for_stage(1)])
def test_gathered_layout_trains_like_stored_to_the_bit(pair: Cluster, sharding: ShardingSpec) -> None:
    """FSDP's layout (the fp32 shard is the master, cast at each gather) and DeepSpeed's (a
    stored bf16 copy beside an fp32 master) run the same numbers: on 2 ranks, with hpZ, without
    resharding after forward, and at stage 1 where parameters are replicated (stored there)."""
    runs = []
    for layout in ("stored", "gathered"):
        spec = StrategySpec(sharding=sharding, wrapping=TransformerWrap(), precision=PrecisionSpec(
            param_dtype="bf16", master_dtype="fp32", compute_copy=layout))
        runs.append(pair.run(NATIVE, spec=spec, steps=4)[0])
    stored, gathered = runs
    assert stored.losses == gathered.losses and stored.grad_norms == gathered.grad_norms  # type: ignore[attr-defined]
    for name, value in stored.state.items():  # type: ignore[attr-defined]
        assert torch.equal(value, gathered.state[name]), name  # type: ignore[attr-defined]


def test_fp16_dynamic_loss_scale_skips_overflow_steps(pair: Cluster) -> None:
    scaling = DynamicLossScale(initial_scale=2.0**20, hysteresis=1, growth_interval=1000)
    spec = StrategySpec(sharding=ShardingSpec.for_stage(2), precision=PrecisionSpec(
        param_dtype="fp16", master_dtype="fp32", reduce_dtype="fp32", loss_scaling=scaling))
    result: Any = pair.run(NATIVE, spec=spec, steps=12, optimizer="sgd")[0]
    counts = [s["skipped_steps"] for s in result.stats]
    scales = [s["loss_scale"] for s in result.stats]
    skipped = tuple(i for i, c in enumerate(counts) if c > (counts[i - 1] if i else 0))
    assert skipped[:1] == (0,), "2^20 overflows fp16 gradients: the first step is skipped"
    assert 2 <= len(skipped) < 10, "the scale comes down until steps go through"
    assert scales == [2.0 ** (20 - c) for c in counts], "each overflow halves the scale (hysteresis 1)"
    assert all(torch.isfinite(v).all() for v in result.state.values())
    ref = run_reference(steps=12, optimizer="sgd", skip_steps=skipped)
    assert max(_rel(a, b) for a, b in zip(result.losses, ref.losses)) <= 2e-2
    for name, value in ref.state.items():
        assert (result.state[name] - value).abs().max().item() <= 2e-2, name


def test_tiny_gpt_stage3_matches_one_process(pair: Cluster) -> None:
    results: Any = pair.run("zerobridge.testing.gpt:train_gpt", stage=3, steps=4)
    ref = reference_gpt(steps=4)
    assert_close_run(results[0], ref, rtol=1e-5, atol=5e-5)
    assert ref.losses[-1] < ref.losses[0]


def test_config_from_the_environment() -> None:
    with Cluster(2, timeout_s=60, env={"ZEROBRIDGE_CONFIG": "stage:3"}) as cluster:
        results: Any = cluster.run(NATIVE, from_env=True, steps=10)
    assert results[0].summary.startswith("stage 3")
    assert_close_run(results[0], reference(), rtol=1e-5, atol=5e-5)


def test_a_peer_that_never_joins_is_a_timeout_not_a_hang() -> None:
    with Cluster(2, timeout_s=60, group_timeout_s=3) as cluster, pytest.raises(RankError) as caught:
        cluster.run("zerobridge.testing.parity:leave_early", rank_that_leaves=1)
    assert caught.value.ranks == (0,)
    assert "timed out" in str(caught.value).lower() or "timeout" in str(caught.value).lower()
