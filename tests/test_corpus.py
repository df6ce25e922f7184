"""Every public config in ../shared/corpus converts to every target.

Skipped when the corpus is absent (set ZEROBRIDGE_CORPUS to point at it).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml
from conftest import corpus_files, in_original_layout

from zerobridge.cli import main
from zerobridge.load import load_spec
from zerobridge.translate.formats import TARGETS, YAML_TARGETS

pytestmark = pytest.mark.corpus

CONVERTIBLE = corpus_files("deepspeed") + corpus_files("accelerate")


def written(out: str, target: str) -> dict[str, object]:
    """What ``convert --to target`` printed, parsed as its consumer would: the Trainer targets print one line of
    flags (the config inline), torchtitan a TOML, the Accelerate targets YAML, the others JSON."""
    if target.startswith("trainer-"):
        assert out.count("\n") == 1 and (out.startswith("--") or not out.strip()), out  # stage 0: plain DDP
        return {"flags": shlex.split(out)}
    if target == "torchtitan":
        return tomllib.loads(out)
    return dict(yaml.safe_load(out) if target in YAML_TARGETS else json.loads(out))


@pytest.mark.parametrize("path", CONVERTIBLE, ids=lambda p: p.name)
def test_converts_to_every_target(path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = in_original_layout(path, tmp_path)
    for target in sorted(TARGETS):
        code = main(["convert", str(path), "--to", target, "--explain"])
        out, err = capsys.readouterr()
        if target == "torchtitan" and code == 2:  # a clean refusal naming what (fp16 compute, DDP of no size)
            assert "torchtitan has no form for it" in err and "fix:" in err, err
            continue
        assert code == 0, f"{target}: {err}"
        value = written(out, target)
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
