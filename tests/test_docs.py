"""Generated docs are current, and every hand-written doc command is real."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from zerobridge.docgen import render_all

REPO = Path(__file__).resolve().parents[1]


def test_generated_docs_are_current() -> None:
    stale = [str(p.relative_to(REPO)) for p, text in render_all().items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"regenerate with `python -m zerobridge.docgen`: {stale}"


def test_readme_states_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_every_documented_target_exists() -> None:
    from zerobridge.translate.formats import TARGETS

    text = "".join(p.read_text(encoding="utf-8") for p in (REPO / "docs").glob("*.md"))
    text += (REPO / "README.md").read_text(encoding="utf-8")
    for target in set(re.findall(r"--to ([a-z0-9-]+)", text)):
        assert target in TARGETS, f"docs mention --to {target}, which does not exist"


def _bench(name: str) -> Any:
    import importlib.util
    import sys

    if str(REPO / "bench") not in sys.path:  # as `python bench/NAME.py` runs it: siblings importable
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_big_model_table_is_the_committed_results() -> None:
    """docs/big-models.md carries the table bench/big_model.py renders from bench/results/big_model.json."""
    import json

    bench = _bench("big_model")
    results = json.loads((REPO / "bench" / "results" / "big_model.json").read_text(encoding="utf-8"))
    doc = (REPO / "docs" / "big-models.md").read_text(encoding="utf-8")
    assert bench.splice(doc, bench.table(results)) == doc, "rerun `python bench/big_model.py --render`"


def test_plan_accuracy_block_is_the_committed_results() -> None:
    """docs/plan.md carries the block bench/plan.py renders from bench/results/plan.json."""
    import json

    bench = _bench("plan")
    results = json.loads((REPO / "bench" / "results" / "plan.json").read_text(encoding="utf-8"))
    doc = (REPO / "docs" / "plan.md").read_text(encoding="utf-8")
    assert bench.splice(doc, bench.table(results), (bench.BEGIN, bench.END)) == doc, \
        "rerun `python bench/plan.py --render`"


@pytest.mark.parametrize("name", ["compile", "engine_scale", "host_overhead", "mixed_precision", "zero3_overhead"])
def test_benchmark_block_is_the_committed_results(name: str) -> None:
    """docs/benchmarks.md carries the block bench/NAME.py renders from bench/results/NAME.json."""
    import json

    bench = _bench(name)
    results = json.loads((REPO / "bench" / "results" / f"{name}.json").read_text(encoding="utf-8"))
    doc = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert bench.splice(doc, bench.table(results), (bench.BEGIN, bench.END)) == doc, \
        f"rerun `python bench/{name}.py --render`"


def test_benchmark_table_is_the_committed_results() -> None:
    """docs/benchmarks.md carries the table bench/backends.py renders from bench/results/backends.json."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_backends", REPO / "bench" / "backends.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = json.loads((REPO / "bench" / "results" / "backends.json").read_text(encoding="utf-8"))
    doc = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert bench.splice(doc, bench.table(results)) == doc, "rerun `python bench/backends.py --render`"
    assert (REPO / "bench" / "results" / "backends.png").is_file()
