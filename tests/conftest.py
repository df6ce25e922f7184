"""Shared fixtures: where the public config corpus is (tests skip without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

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
