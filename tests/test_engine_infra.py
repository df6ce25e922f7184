"""Running beyond this machine: older torch, prepared models that move, device binding.

Worker functions below run on the ranks of a ``Cluster`` (spawned once per
world size for the module); the other tests run in this process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerobridge.engine import collectives
from zerobridge.testing.cluster import Cluster, clusters as cluster_set
from zerobridge.testing.parity import run_native, run_reference

ME = "tests.test_engine_infra"
NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(2) as made:
        yield made


@pytest.fixture
def solo_group() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- torch floor


def train_without_new_names(*, stage: int) -> dict[str, Any]:
    """Worker: train as a torch without the 2.13 names would, counting the older calls."""
    hidden = {name: getattr(dist, name) for name in NEW_NAMES}
    calls = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}
    older = {name: getattr(dist, name) for name in calls}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return older[name](*args, **kwargs)
        return call
    for name in NEW_NAMES:
        delattr(dist, name)
    for name in calls:
        setattr(dist, name, counted(name))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 2.13 deprecates the older names
            result = run_native(stage=stage, steps=3)
    finally:
        for name, fn in {**hidden, **older}.items():
            setattr(dist, name, fn)
    return {"losses": result.losses, "calls": calls}


def test_flat_collectives_fall_back_to_the_older_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert collectives.flat_collective("all_gather") is dist.all_gather_single
    for name in NEW_NAMES:
        monkeypatch.delattr(dist, name)
    assert collectives.flat_collective("all_gather") is dist.all_gather_into_tensor
    assert collectives.flat_collective("reduce_scatter") is dist.reduce_scatter_tensor


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_training_without_the_213_names_matches(clusters: dict[int, Cluster], stage: int) -> None:
    reference = run_reference(steps=3)
    for result in clusters[2].run(f"{ME}:train_without_new_names", stage=stage):
        assert result["calls"]["all_gather_into_tensor"] > 0 and result["calls"]["reduce_scatter_tensor"] > 0
        torch.testing.assert_close(result["losses"], reference.losses, rtol=1e-5, atol=0)
