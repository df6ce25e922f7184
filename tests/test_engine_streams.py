"""The engine's stream design, checked on a CPU through a backend that records what CUDA
streams would run (``zerobridge.testing.streams``): gathers and reductions on their side
streams, every gathered buffer used only after its gather's event, the next unit
prefetched in forward by default within the memory bounds, the hybrid all-reduce in
flight beside the other reductions, and unchanged numbers.

One gloo group of 2 ranks and one of 4 (hybrid: shard groups of 2) for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from zerobridge.engine.swapfile import HostRegion
from zerobridge.harness.cluster import Cluster, clusters
from zerobridge.spec import ShardingSpec, StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing.parity import ParityNet

RUN = "zerobridge.testing.streams:run_recorded"
Log = list[tuple[Any, ...]]


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[int, Cluster]]:
    with clusters(2, 4) as made:
        yield made


def stage3(**communication: Any) -> StrategySpec:
    spec = spec_for_stage(3, ParityNet(0))
    return spec.model_copy(update={"communication": spec.communication.model_copy(update=communication)})


def hybrid() -> StrategySpec:
    spec = stage3()
    return spec.model_copy(update={"sharding": ShardingSpec.for_stage(3, shard_group=2, world_size=4)})


def hpz() -> StrategySpec:
    spec = stage3()
    return spec.model_copy(update={"sharding": ShardingSpec.for_stage(3, backward_gather_group=2, world_size=4)})


def steps(log: Log) -> list[Log]:
    """Each step's forward and backward (from its ``("step", k)`` to its optimizer step)."""
    out: list[Log] = []
    for entry in log:
        if entry[0] == "step":
            out.append([])
        elif entry[0] == "optimizer":
            out.append(None)  # type: ignore[arg-type]
        elif out and out[-1] is not None:
            out[-1].append(entry)
    return [s for s in out if s is not None]


def last_gather_into(seg: Log, ptr: int, before: int) -> int | None:
    hits = [i for i, e in enumerate(seg[:before]) if e[0] == "all_gather" and e[2] == ptr]
    return hits[-1] if hits else None


def check_gathers(seg: Log) -> int:
    """Every gather on the gather stream, in order there, after the pass's wait for the
    compute stream; every unit's compute after its gather's event, with the buffer handed
    to the compute stream. Returns how many computes read a gathered buffer."""
    gathers = [i for i, e in enumerate(seg) if e[0] == "all_gather"]
    assert gathers, "no all-gather in the step"
    assert all(seg[i][1] == "gather" and seg[i][4] is False for i in gathers), [seg[i] for i in gathers]
    assert ("wait_stream", "gather", "compute") in seg[:gathers[0]]
    checked = 0
    for c, entry in enumerate(seg):
        if entry[0] != "compute" or entry[2] == 0:
            continue
        g = last_gather_into(seg, entry[2], c)
        if g is None:
            continue
        records = [i for i in range(g + 1, c) if seg[i][:2] == ("record", "gather")]
        assert records, f"compute {entry} reads a gather no event follows"
        event = seg[records[0]][2]
        assert ("wait_event", "compute", event) in seg[records[0]:c], f"compute {entry} does not wait for {event}"
        assert ("record_stream", "compute", entry[2]) in seg[g:c], f"{entry}'s buffer not handed to compute"
        checked += 1
    marks = [e[2] for e in seg if e[:2] == ("record", "gather")]
    waited = {e[2] for e in seg if e[:2] == ("wait_event", "compute")}
    assert set(marks) <= waited, "a gather the compute stream never waited for"
    return checked


def check_reductions(seg: Log, *, hybrid: bool) -> None:
    """Reduce-scatters on the reduce stream after the compute stream's event for their gradient,
    hybrid all-reduces on the replicate stream after the reduce stream, and the compute
    stream joining both before the step's own all-reduce (used parameters)."""
    scatters = [i for i, e in enumerate(seg) if e[0] == "reduce_scatter"]
    assert scatters
    previous = 0
    for i in scatters:
        assert seg[i][1] == "reduce" and seg[i][4] is False, seg[i]
        computed = {e[2] for e in seg[previous:i] if e[:2] == ("record", "compute")}
        assert any(e[:2] == ("wait_event", "reduce") and e[2] in computed for e in seg[previous:i]), seg[previous:i]
        previous = i
    across = [i for i, e in enumerate(seg) if e[0] == "all_reduce" and e[1] == "replicate"]
    assert len(across) == (len(scatters) if hybrid else 0)
    for i in across:  # after the event the reduce stream recorded behind a reduce-scatter
        scattered = {seg[k + 1][2] for k in scatters if k < i and seg[k + 1][:2] == ("record", "reduce")}
        assert any(e[:2] == ("wait_event", "replicate") and e[2] in scattered for e in seg[:i]) and seg[i][4] is False
    control = [i for i, e in enumerate(seg) if e[0] == "all_reduce" and e[1] == "compute"]
    assert len(control) == 1, [seg[i] for i in control]
    for stream in ("reduce", "replicate"):
        joins = [i for i, e in enumerate(seg) if e == ("wait_stream", "compute", stream)]
        assert joins and max(scatters + across) < joins[-1] < control[0]


@pytest.mark.distributed
def test_gathers_and_reductions_run_on_side_streams_with_events(groups: dict[int, Cluster]) -> None:
    for world, spec, is_hybrid in ((2, stage3(), False), (4, hybrid(), True), (4, hpz(), False)):
        results: Any = groups[world].run(RUN, spec=spec, steps=3)
        for result in results:
            checked = 0
            for seg in steps(result["log"]):
                checked += check_gathers(seg)
                check_reductions(seg, hybrid=is_hybrid)
            assert checked >= 3 * 3, checked  # every unit of every step


@pytest.mark.distributed
def test_forward_prefetches_the_next_unit_by_default_within_the_bounds(groups: dict[int, Cluster]) -> None:
    def feeding_order(spec: StrategySpec) -> list[bool]:
        result: Any = groups[2].run(RUN, spec=spec, steps=2)[0]
        seg = steps(result["log"])[1]  # the second step follows the first one's order
        computes = [(i, e) for i, e in enumerate(seg) if e[0] == "compute" and last_gather_into(seg, e[2], i)]
        # Was the gather feeding each unit issued before the previous unit computed?
        return [last_gather_into(seg, e[2], i) < j  # type: ignore[operator]
                for (j, _), (i, e) in zip(computes, computes[1:])]

    assert stage3().communication.forward_prefetch is False
    assert feeding_order(stage3()) == [True, True]
    # A live-parameter cap below one unit: nothing is prefetched, the bound holds.
    assert feeding_order(stage3(max_live_parameters=1)) == [False, False]


@pytest.mark.distributed
def test_hybrid_all_reduce_stays_in_flight_without_streams(groups: dict[int, Cluster]) -> None:
    results: Any = groups[4].run(RUN, spec=hybrid(), steps=2, record=False)
    for result in results:
        log = result["log"]
        across = [(i, e) for i, e in enumerate(log) if e[0] == "all_reduce" and e[3] == 2]
        assert across and all(e[4] is True for _, e in across), across  # asynchronous
        overlapped = 0
        for i, e in across:
            waited = log.index(("wait", e[5]), i)
            overlapped += any(x[0] in ("reduce_scatter", "all_reduce") for x in log[i + 1:waited])
        assert overlapped >= 2, across  # in flight while other reductions were issued


@pytest.mark.distributed
def test_streams_change_no_number(groups: dict[int, Cluster]) -> None:
    for world, spec in ((2, stage3()), (4, hybrid()), (4, hpz())):
        recorded: Any = groups[world].run(RUN, spec=spec, steps=3)
        plain: Any = groups[world].run(RUN, spec=spec, steps=3, record=False)
        assert recorded[0]["losses"] == plain[0]["losses"]


def test_host_reads_are_non_blocking_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu tier's shard comes in with a non-blocking copy when its host tensor is pinned
    (on CUDA the copy then overlaps; it is ordered on the gather stream)."""
    calls: list[bool] = []
    original = torch.Tensor.copy_

    def copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(non_blocking)
        return original(self, src, non_blocking=non_blocking)

    region = HostRegion(torch.arange(6.0))
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr("zerobridge.engine.swapfile.reads_into_device", lambda out: True)
    out = region.read(2, torch.empty(3))
    assert out.tolist() == [2.0, 3.0, 4.0] and calls == [True]
