"""Every public config in ../shared/corpus converts to every target.

Skipped when the corpus is absent (set ZEROBRIDGE_CORPUS to point at it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import corpus_files, in_original_layout

from zerobridge.cli import main
from zerobridge.load import load_spec
from zerobridge.translate.formats import TARGETS, YAML_TARGETS

pytestmark = pytest.mark.corpus

CONVERTIBLE = corpus_files("deepspeed") + corpus_files("accelerate")


@pytest.mark.parametrize("path", CONVERTIBLE, ids=lambda p: p.name)
def test_converts_to_every_target(path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = in_original_layout(path, tmp_path)
    for target in sorted(TARGETS):
        code = main(["convert", str(path), "--to", target, "--explain"])
        out, err = capsys.readouterr()
        assert code == 0, f"{target}: {err}"
        value = yaml.safe_load(out) if target in YAML_TARGETS else json.loads(out)
        assert isinstance(value, dict) and value, target
        assert " -> spec" in err and f"spec -> {target}" in err  # both halves of the report


@pytest.mark.parametrize("path", corpus_files("torchtitan"), ids=lambda p: p.name)
def test_torchtitan_reads_into_the_spec(path: Path) -> None:
    translation = load_spec(path)
    assert translation.value.sharding.stage.value == 3  # torchtitan shards with FSDP2
    assert translation.report.entries


def test_corpus_is_really_there_when_present() -> None:
    if not CONVERTIBLE:
        pytest.skip("no corpus")
    assert len(corpus_files("deepspeed")) >= 30 and len(corpus_files("accelerate")) >= 15
