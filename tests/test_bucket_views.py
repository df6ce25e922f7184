"""The replicated groups' buckets reduce while backward runs (``engine/bucket_views.py``): each bucket's
views are cut again at its first module, so its gradient is ready once backward has passed that module,
not when the backward ends; under ``torch.compile`` the cut moves to the units, outside the graphs.

Worker functions below run on the ranks of a ``Cluster`` (spawned once for the module); the other tests
run in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from zerobridge.engine import collectives
from zerobridge.harness.cluster import Cluster
from zerobridge.spec import CommunicationSpec, CompileSpec, ShardingSpec, StrategySpec, TransformerWrap
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing.parity import ParityNet, run_native, run_reference

ME = "tests.test_bucket_views"
LAYERS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(2) as made:
        yield made


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(LAYERS)))


def reductions_during_backward(*, stage: int) -> list[str]:
    """Worker: one backward of a stack of linear layers at ``stage``, a bucket per layer; the order of its
    reductions (``reduce``) and of the first layer's input gradient (``input``), made by the last op of
    backward."""
    import zerobridge

    spec = StrategySpec(sharding=ShardingSpec.for_stage(stage), communication=CommunicationSpec(reduce_bucket=72))
    model = zerobridge.prepare(_stack(), config=spec)
    events: list[str] = []
    for name in ("reduce_scatter", "all_reduce"):
        original = getattr(collectives, name)

        def logged(*args: Any, original: Any = original, **kwargs: Any) -> Any:
            events.append("reduce")
            return original(*args, **kwargs)
        setattr(collectives, name, logged)
    x = torch.ones(2, 8, requires_grad=True)
    x.register_hook(lambda grad: events.append("input"))
    model(x).sum().backward()
    return events


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_a_bucket_reduces_once_backward_has_passed_its_layer(cluster: Cluster, stage: int) -> None:
    """Before: the buckets' views were cut at the root's pre-forward, so every reduction ran after the
    whole backward (the first layer's input gradient came before all of them)."""
    for events in cluster.run(f"{ME}:reductions_during_backward", stage=stage):
        reductions_before = events[:events.index("input")].count("reduce")
        assert reductions_before == LAYERS - 1, events  # every layer's but the first's, whose backward made it
        assert events.count("reduce") >= LAYERS


def train_in_buckets(*, stage: int) -> list[float]:
    """Worker: ParityNet trained at ``stage`` with a bucket per parameter, each cut at its first module."""
    spec = spec_for_stage(stage, ParityNet(0))
    spec = spec.model_copy(update={"communication": spec.communication.model_copy(update={"reduce_bucket": 1})})
    return run_native(spec=spec, steps=4).losses


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_training_in_buckets_cut_at_first_use_matches_one_process(cluster: Cluster, stage: int) -> None:
    reference = run_reference(steps=4)
    for losses in cluster.run(f"{ME}:train_in_buckets", stage=stage):
        torch.testing.assert_close(losses, reference.losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_cut_waits_on_modules_or_under_compile_on_units(solo_group: None, compiled: bool) -> None:
    import zerobridge

    wrapped = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    spec = StrategySpec(communication=CommunicationSpec(reduce_bucket=72), compile=CompileSpec(enabled=compiled),
                        wrapping=TransformerWrap(layer_classes=["Sequential"]))
    before = {id(m): len(m._forward_pre_hooks) for m in wrapped.modules()}
    model = zerobridge.prepare(wrapped, config=spec)
    units = {id(u.module) for u in model._zerobridge_engine.units}
    hooked = {id(m) for m in model.modules() if len(m._forward_pre_hooks) > before[id(m)] + (id(m) in units)}
    linears = {id(m) for m in model.modules() if isinstance(m, nn.Linear)}
    inner = units - {id(model)}
    # off: the modules that hold the parameters; on: the parameters' units (the root's first Linear keeps the
    # root's cut), whose hooks run outside the compiled forwards
    assert hooked == (inner if compiled else linears)


class _Probe(nn.Module):
    """Runs its first layer once without gradients (a probe, a teacher pass), then trains through both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            probe = self.first(x)
        return self.second(self.first(x) + probe)


def test_a_bucket_first_used_without_gradients_still_gets_them(solo_group: None) -> None:
    """Cut at a use under no_grad, a bucket's views would carry no gradient to the use after it."""
    import zerobridge

    reference = _Probe()
    reference(torch.ones(2, 8)).sum().backward()
    model = zerobridge.prepare(_Probe(), config=StrategySpec(communication=CommunicationSpec(reduce_bucket=72)))
    model(torch.ones(2, 8)).sum().backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad)
