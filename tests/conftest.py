"""Shared fixtures: where the public config corpus is (tests skip without it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from zerobridge.backends.deepspeed.extensions import same_ninja

REPO = Path(__file__).resolve().parents[1]

same_ninja()  # every process the suite starts builds DeepSpeed's ops with one ninja (extensions.py says why)


def corpus_dir() -> Path | None:
    """``$ZEROBRIDGE_CORPUS`` or ``../shared/corpus`` beside the repository."""
    env = os.environ.get("ZEROBRIDGE_CORPUS")
    candidate = Path(env) if env else REPO.parent / "shared" / "corpus"
    return candidate if candidate.is_dir() else None


def corpus_files(kind: str) -> list[Path]:
    """Corpus files of one kind (deepspeed, accelerate, torchtitan); [] without a corpus."""
    root = corpus_dir()
    return sorted((root / kind).iterdir()) if root and (root / kind).is_dir() else []


def in_original_layout(path: Path, tmp_path: Path) -> Path:
    """An Accelerate YAML whose deepspeed_config_file is a relative path only
    resolves in its repository's layout: rebuild that layout from the corpus
    (``owner__repo__dir__file`` names) in a temporary directory."""
    if path.suffix not in (".yaml", ".yml"):
        return path
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    ref = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ref or Path(ref).is_absolute():
        return path
    *repo_dirs, _ = path.name.split("__")[2:]
    here = tmp_path.joinpath(*repo_dirs)
    here.mkdir(parents=True)
    (here / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    target = (here / ref).resolve()
    owner_repo = "__".join(path.name.split("__")[:2])
    rel = target.relative_to(tmp_path.resolve())
    source = path.parent.parent / "deepspeed" / f"{owner_repo}__{'__'.join(rel.parts)}"
    assert source.exists(), f"{path.name} refers to {ref}, which the corpus lacks"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return here / path.name


@pytest.fixture
def corpus() -> Path:
    root = corpus_dir()
    if root is None:
        pytest.skip("no ../shared/corpus (set ZEROBRIDGE_CORPUS)")
    return root


# ----------------------------------------------------------------------------- the suite's time budget

SLOWEST = 15
"""How many of the slowest tests every run prints."""
TEST_BUDGET_S = 60.0
"""No single test (setup, call and teardown together) should take longer."""
_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The slowest tests (setup + call + teardown), the time per module, and the tests over the budget:
    printed by every run, so a regression in the suite's time shows where it happened."""
    if not _SPENT:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"time: the {SLOWEST} slowest tests, and per module")
    for nodeid, spent in sorted(_SPENT.items(), key=lambda item: -item[1])[:SLOWEST]:
        write(f"{spent:8.1f} s  {nodeid}")
    modules: dict[str, float] = {}
    for nodeid, spent in _SPENT.items():
        module = nodeid.split("::", 1)[0]
        modules[module] = modules.get(module, 0.0) + spent
    write("")
    for module, spent in sorted(modules.items(), key=lambda item: -item[1]):
        write(f"{spent:8.1f} s  {module}")
    write(f"{sum(modules.values()):8.1f} s  in {len(_SPENT)} tests")
    over = [nodeid for nodeid, spent in _SPENT.items() if spent > TEST_BUDGET_S]
    if over:
        write(f"over the {TEST_BUDGET_S:.0f} s budget per test: {', '.join(sorted(over))}", yellow=True)


# ----------------------------------------------------------------------------- one-rank groups started here


@pytest.fixture
def solo_group() -> Iterator[None]:
    """A test that prepares in this process starts a one-rank group: end it after the test (a module whose
    every test does so marks itself ``pytest.mark.usefixtures("solo_group")``)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- no process group leaks out of a module


@pytest.fixture(autouse=True, scope="module")
def _no_group_left_behind(request: pytest.FixtureRequest) -> Any:
    """Fail a module that leaves a process group in the pytest process: every later module would inherit it
    (one did: its in-process ``prepare`` calls started a one-rank group, and a later module's plan then went to
    a subprocess instead of the monkeypatched in-process path). The group is destroyed after the report, so
    the modules after it run as they would alone."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.module.__name__} left a process group in the pytest process: destroy it in the "
                    "module's teardown (torch.distributed.destroy_process_group())", pytrace=False)
