"""DeepSpeed's op builds: one folder per user and torch version by default; stale build locks removed first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerobridge.backends.deepspeed.extensions import LIVE_S, default_dir, extensions_dir, same_ninja


def _lock(folder: Path, op: str, age_s: float) -> Path:
    (folder / op).mkdir(parents=True)
    lock = folder / op / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_unset_means_one_folder_per_user_and_torch_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env: dict[str, str] = {}
    assert extensions_dir(env) == default_dir() == tmp_path / "zerobridge" / "torch_extensions" / \
        f"torch-{torch.__version__}"
    assert env["TORCH_EXTENSIONS_DIR"] == str(default_dir())
    assert extensions_dir({"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}) == tmp_path / "mine"  # set: kept


def test_a_stale_lock_is_removed_with_a_warning_and_a_live_one_kept(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    stale = _lock(tmp_path, "fused_adam", 2 * LIVE_S)
    young = _lock(tmp_path, "cpu_adam", 1.0)  # a build that may not have started ninja yet
    building = _lock(tmp_path, "deepspeed_shm_comm", 2 * LIVE_S)
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=building.parent)
    try:
        extensions_dir({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    finally:
        ninja.kill()
        ninja.wait()
    assert not stale.exists() and young.exists() and building.exists()
    err = capsys.readouterr().err
    assert f"zerobridge: warning: removed {stale}: a stale DeepSpeed build lock" in err
    assert str(young) not in err and str(building) not in err


def test_every_process_of_an_environment_builds_with_its_own_ninja(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ninja versions hash build commands differently and rebuild each other's objects: the
    interpreter's folder goes first on PATH when it holds one, once, and nowhere else."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    env = {"PATH": os.pathsep.join(["/usr/local/bin", "/usr/bin", str(venv)])}
    assert not same_ninja(env) and env["PATH"].startswith("/usr/local/bin")  # no ninja in the venv: untouched
    (venv / "ninja").touch()
    assert same_ninja(env)
    assert env["PATH"].split(os.pathsep) == [str(venv), "/usr/local/bin", "/usr/bin"]
    assert not same_ninja(env)  # already first
    env = {"PATH": "/usr/bin", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    extensions_dir(env)
    assert env["PATH"].split(os.pathsep) == [str(venv), "/usr/bin"]
