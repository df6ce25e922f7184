"""Shared fixtures: where the public config corpus is (tests skip without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def corpus_dir() -> Path | None:
    """``$ZEROBRIDGE_CORPUS`` or ``../shared/corpus`` beside the repository."""
    env = os.environ.get("ZEROBRIDGE_CORPUS")
    candidate = Path(env) if env else REPO.parent / "shared" / "corpus"
    return candidate if candidate.is_dir() else None


def corpus_files(kind: str) -> list[Path]:
    """Corpus files of one kind (deepspeed, accelerate, torchtitan); [] without a corpus."""
    root = corpus_dir()
    return sorted((root / kind).iterdir()) if root and (root / kind).is_dir() else []


@pytest.fixture
def corpus() -> Path:
    root = corpus_dir()
    if root is None:
        pytest.skip("no ../shared/corpus (set ZEROBRIDGE_CORPUS)")
    return root
