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


# ---------------------------------------------------------------------- moving a prepared model


def _prepared(stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import zerobridge

    torch.manual_seed(0)
    model = zerobridge.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                                   torch.nn.Linear(4, 1)), stage=stage)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("convert", ["half", "double", "to_bf16", "to_meta"])
def test_a_cast_or_move_of_a_prepared_model_is_refused(solo_group: None, stage: int, convert: str) -> None:
    from zerobridge.errors import ConfigError

    model, _ = _prepared(stage)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    calls = {"half": lambda: model.half(), "double": lambda: model.double(),
             "to_bf16": lambda: model.to(torch.bfloat16), "to_meta": lambda: model.to("meta")}
    with pytest.raises(ConfigError, match="stale") as info:
        calls[convert]()
    assert "before zerobridge.prepare" in (info.value.fix or "")
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_conversion_that_changes_nothing_keeps_training_the_engine(solo_group: None, stage: int) -> None:
    import zerobridge

    model, opt = _prepared(stage)
    assert model.float() is model and model.to("cpu") is model and model.to(torch.float32) is model
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = zerobridge.full_state_dict(model)
    shown = dict(model.named_parameters())
    if stage == 0:  # one shard: the parameters are the whole tensors the engine steps
        for name, value in shown.items():
            torch.testing.assert_close(full[name], value.detach(), rtol=0, atol=0)
    with torch.no_grad():
        expected = torch.nn.functional.linear(torch.nn.functional.layer_norm(
            torch.nn.functional.linear(x, full["0.weight"], full["0.bias"]), (4,), full["1.weight"], full["1.bias"]),
            full["2.weight"], full["2.bias"])
        torch.testing.assert_close(model(x), expected)
