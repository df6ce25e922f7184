"""The native engine against a single-process reference, on gloo.

Every case trains ``ParityNet`` (uneven sizes, tied embedding/head, a frozen
layer, an unused parameter, LayerNorm, param groups without weight decay on
biases and norms) for 10 steps with the global batch split across ranks, and
compares per-step loss and global grad norm (1e-5 relative) and the final
full parameters (5e-5 absolute) with one process training on the whole batch.
One process group per world size serves every case of this module. Set
``ZEROBRIDGE_TEST_DEVICE=cuda`` to run the same cases on GPUs with NCCL.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import torch

from zerobridge.harness.cluster import Cluster
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.spec import ShardingSpec, StrategySpec
from zerobridge.testing.parity import RunResult, run_reference

pytestmark = pytest.mark.distributed

NATIVE = "zerobridge.testing.parity:run_native"
LOSS_RTOL, PARAM_ATOL = 1e-5, 5e-5


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(1, 2, 4) as made:
        yield made


@cache
def reference(optimizer: str = "adamw", accumulation: int = 1, steps: int = 10) -> RunResult:
    return run_reference(optimizer=optimizer, accumulation=accumulation, steps=steps)


def assert_parity(results: list[RunResult], ref: RunResult, *, rtol: float = LOSS_RTOL,
                  atol: float = PARAM_ATOL) -> None:
    for rank_result in results:  # every rank reports the same global numbers
        assert rank_result.losses == results[0].losses
    got = results[0]
    assert len(got.losses) == len(ref.losses) >= 10
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= rtol * abs(b), f"loss at step {step}: {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= rtol * abs(b), f"grad norm at step {step}: {a} vs reference {b}"
    assert abs(got.eval_loss - ref.eval_loss) <= rtol * abs(ref.eval_loss), "forward under no_grad after training"
    assert set(got.state) == set(ref.state)
    for name, value in ref.state.items():
        assert got.state[name].shape == value.shape, name
        err = (got.state[name].float() - value).abs().max().item()
        assert err <= atol, f"{name}: max abs error {err}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("world", "optimizer"), [(1, "adamw"), (2, "adamw"), (2, "sgd"), (4, "adamw"), (4, "sgd")])
def test_stage_matches_single_process(clusters: dict[int, Cluster], world: int, stage: int, optimizer: str) -> None:
    results = clusters[world].run(NATIVE, stage=stage, optimizer=optimizer)
    assert_parity(results, reference(optimizer))  # type: ignore[arg-type]


HYBRID = {
    "hybrid zero3 2x2": StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2)),
    "hybrid zero2 2x2": StrategySpec(sharding=ShardingSpec.for_stage(2, shard_group=2)),
    "hybrid shard_grad_op 2x2": StrategySpec(sharding=ShardingSpec.for_stage(
        3, shard_group=2, parameters="reshard_after_backward")),
    "hpZ zero3 groups of 2": StrategySpec(sharding=ShardingSpec.for_stage(3, backward_gather_group=2)),
}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_matches_single_process(clusters: dict[int, Cluster], name: str, optimizer: str) -> None:
    results = clusters[4].run(NATIVE, spec=HYBRID[name], optimizer=optimizer)
    assert_parity(results, reference(optimizer))  # type: ignore[arg-type]


@pytest.mark.parametrize(("stage", "mode"), [
    (0, "spec"), (1, "no_sync"), (1, "spec"), (2, "spec"), (2, "no_sync"), (3, "plain"), (3, "no_sync"),
])
def test_gradient_accumulation(clusters: dict[int, Cluster], stage: int, mode: str) -> None:
    results = clusters[2].run(NATIVE, stage=stage, optimizer="sgd", accumulation=2, accumulation_mode=mode)
    assert_parity(results, reference("sgd", accumulation=2))  # type: ignore[arg-type]


def test_prepare_keeps_an_optimizer_built_before(clusters: dict[int, Cluster]) -> None:
    results = clusters[2].run(NATIVE, stage=3, optimizer="adamw", prepare_optimizer=True)
    assert_parity(results, reference("adamw"))  # type: ignore[arg-type]


def test_unused_and_frozen_parameters_do_not_change(clusters: dict[int, Cluster]) -> None:
    results: Any = clusters[2].run(NATIVE, stage=3, optimizer="adamw")
    from zerobridge.testing.parity import ParityNet
    initial = ParityNet(0).state_dict()
    for name in ("unused.weight", "unused.bias", "frozen.weight", "frozen.bias"):
        assert torch.equal(results[0].state[name], initial[name]), name
    assert not torch.equal(results[0].state["embed.weight"], initial["embed.weight"])
    assert torch.equal(results[0].state["embed.weight"], results[0].state["head.weight"])
    original = ParityNet(0)
    assert results[0].names == ([n for n, _ in original.named_parameters(remove_duplicate=False)]
                                + list(original.state_dict())), "names survive sharding"


def test_sharding_changes_nothing_between_stages(clusters: dict[int, Cluster]) -> None:
    """Across stages at one world size the runs agree far tighter than with the reference."""
    runs: list[Any] = [clusters[2].run(NATIVE, stage=s, optimizer="sgd", steps=10)[0] for s in (0, 3)]
    for a, b in zip(runs[0].losses, runs[1].losses):
        assert abs(a - b) <= 1e-6 * abs(b)
