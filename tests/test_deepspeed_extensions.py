"""DeepSpeed's op builds: one folder per user and torch version by default; stale build locks removed first;
``zerobridge build-ops`` compiles them ahead of a launch and says which it built, found built or could not build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerobridge.backends.deepspeed.extensions import LIVE_S, build_ops, default_dir, extensions_dir, same_ninja
from zerobridge.errors import ConfigError


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


def _build_ops(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobridge.cli", "build-ops", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_build_ops_refuses_an_unknown_op() -> None:
    with pytest.raises(ConfigError, match="unknown DeepSpeed op 'fused_adamw'") as caught:
        build_ops(["fused_adam", "fused_adamw"])
    assert "shm_comm, fused_adam, cpu_adam, cpu_adagrad" in (caught.value.fix or "")
    done = _build_ops("fused_adamw", env=dict(os.environ))
    assert done.returncode == 2 and "unknown DeepSpeed op 'fused_adamw'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_build_ops_compiles_once_then_finds_the_op_built() -> None:
    """In the suite's own folder (``make ops`` built it there; otherwise this is its compile): the second
    call loads what the first left, and says so."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    first = _build_ops("shm_comm", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    again = _build_ops("shm_comm", env=env)
    assert again.returncode == 0 and again.stdout.startswith("shm_comm  already built ("), again.stdout
    assert (Path(env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()


def test_build_ops_reports_an_op_it_cannot_build_and_exits_1(tmp_path: Path) -> None:
    """No working compiler: the op's line says why, the exit code is 1, and no traceback."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path), CXX="/bin/false")
    done = _build_ops("shm_comm", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("shm_comm  cannot be built here: "), done.stdout
    assert "Traceback" not in done.stderr
