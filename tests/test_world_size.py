"""The world size is settled once, before any process starts, the same way in compare, plan and run.

A source written for another world size (Accelerate's ``num_processes``) is
refused by ``zerobridge.load.load_spec_for_world``, naming the file and the
key, with ``convert --world-size`` as the fix; nothing is launched.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from zerobridge.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def eight(tmp_path: Path) -> Path:
    path = tmp_path / "fsdp8.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("argv", [
    ["compare", "--config", "{}", "--steps", "2"],
    ["plan", "tiny-gpt", "--world-size", "2", "--device-memory", "1GiB", "--seq-len", "16", "--config", "{}"],
    ["run", "--nproc", "2", "--config", "{}", str(REPO / "examples" / "train_gpt.py")],
], ids=["compare", "plan", "run"])
def test_another_world_size_is_refused_before_launch(argv: list[str], eight: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    code = main([a.replace("{}", str(eight)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{eight}: num_processes: written for 8 processes" in err
    assert f"zerobridge convert {eight} --to accelerate-fsdp --world-size 2" in err
    assert time.perf_counter() - start < 20  # refused up front: no process group was started


def test_the_same_world_size_passes(eight: Path) -> None:
    from zerobridge.load import load_spec_for_world

    assert load_spec_for_world(eight, 8, flag="--nproc").sharding.world_size == 8
    assert load_spec_for_world(eight, None, flag="--nproc").sharding.world_size == 8  # the launcher cannot tell
