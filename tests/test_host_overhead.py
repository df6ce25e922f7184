"""Host overhead, counted not timed: one training step of the native engine dispatches no more aten ops than
FSDP2's at ZeRO-2 and ZeRO-3 (tiny GPT, world 2, gloo), with the same collectives' worth of work.

Counts are exact and repeatable (``zerobridge.testing.op_count``). What the engine once spent per parameter
per step, and no longer does: a gradient hook writing a tensor flag (select, lift_fresh, copy_), a slice and
a view to hand each gradient to the optimizer, a flattening view before each parameter's norm.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def counts() -> Iterator[dict[tuple[str, int], dict[str, Any]]]:
    from zerobridge.harness.cluster import Cluster

    with Cluster(2, timeout_s=300) as cluster:
        yield {(backend, stage): cluster.run("zerobridge.testing.op_count:step_ops", backend=backend, stage=stage)[0]
               for backend in ("native", "fsdp") for stage in (2, 3)}


@pytest.mark.parametrize("stage", [2, 3])
def test_native_dispatches_no_more_ops_than_fsdp2(counts: dict[tuple[str, int], dict[str, Any]], stage: int) -> None:
    native, fsdp = counts[("native", stage)], counts[("fsdp", stage)]
    print(f"\nZeRO-{stage}, ops per step on rank 0: native {native['total']}, FSDP2 {fsdp['total']} "
          f"({native['total'] / fsdp['total']:.3f}x)")
    assert native["total"] <= fsdp["total"], (native["total"], fsdp["total"])
    # the per-parameter bookkeeping that is gone stays gone
    assert native["by_op"].get("aten.lift_fresh", 0) <= 1 and native["by_op"].get("aten.select", 0) <= 2


def test_the_count_is_the_steps_own_work(counts: dict[tuple[str, int], dict[str, Any]]) -> None:
    """A count that cannot fail is no count: both engines ran the same forward and backward matmuls, and
    the native engine's ZeRO-3 step gathered and reduce-scattered."""
    matmuls = {key: value["by_op"].get("aten.mm", 0) for key, value in counts.items()}
    assert len(set(matmuls.values())) == 1 and next(iter(matmuls.values())) > 0, matmuls
    native3 = counts[("native", 3)]["collectives"]
    assert sum(v for k, v in native3.items() if "allgather" in k) > 0, native3
    assert sum(v for k, v in native3.items() if "reduce_scatter" in k) > 0, native3
