"""Every module's examples run and stay true: one test per module whose source has a ``>>>`` example.

Modules are found by walking the package, so a new module's examples are
checked without being listed anywhere. Examples that call
``zerobridge.prepare`` start a world-1 process group; it is destroyed after
each module, so modules stay independent.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import zerobridge

PACKAGE = Path(zerobridge.__file__).resolve().parent


def _with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _with_examples()


def test_the_walk_finds_every_layer() -> None:
    assert len(MODULES) > 100
    for prefix in ("zerobridge.spec.", "zerobridge.translate.", "zerobridge.runtime.", "zerobridge.engine.",
                   "zerobridge.checkpoint.", "zerobridge.backends.", "zerobridge.compare.", "zerobridge.testing."):
        assert any(name.startswith(prefix) for name in MODULES), prefix


def _runnable(name: str) -> bool:
    """Whether ``name`` has an example not marked ``+SKIP`` (one needing a checkpoint on disk is)."""
    module = importlib.import_module(name)
    text = Path(module.__file__ or "").read_text(encoding="utf-8")
    return any(">>>" in line and "+SKIP" not in line for line in text.splitlines())


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_run(name: str, solo_group: None) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 or not _runnable(name), f"{name} shows >>> examples but none ran (not in a docstring?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
