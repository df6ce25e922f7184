"""The fault suite: a run that saves every 4 steps survives a rank killed mid-step or inside a save, a full
disk, damaged checkpoints and a launcher restart, on the native engine, FSDP2 and ``zerobridge.deepspeed``.

Every case ends one of two ways: the run resumed from ``zerobridge.latest_checkpoint`` (or the engine API's
``latest``) finishes with final weights bit-identical (``torch.equal``) to the uninterrupted run's, or the
fault is refused with a clear error naming the file, and the previous checkpoint still loads. The loop and
the faults are ``zerobridge.testing.faults``; the ranks are one ``Cluster`` of 2 for the module (a killed
rank tears it down; the next case starts a fresh one, as a restarted job would).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

from zerobridge.checkpoint.storage import MANIFEST, StagingLock, latest_checkpoint, leftovers, saving_dir
from zerobridge.testing.faults import BACKENDS, KILLS

pytestmark = pytest.mark.distributed

FAULTS = "zerobridge.testing.faults"
STEPS, SAVE_EVERY = 10, 4
RESUMED_FROM = {"step:6": 4, "save-write:8": 4, "save-manifest:8": 4, "save-swap:8": 8}
"""Where each kill lands and the checkpoint the next attempt resumes from: a save killed before its swap
never happened; one killed after it is complete (the engine API's ``latest`` still names step 4 then)."""
KILL_AT = {"step": "step:6", "save-write": "save-write:8", "save-manifest": "save-manifest:8",
           "save-swap": "save-swap:8"}
assert set(KILL_AT) == set(KILLS)


@pytest.fixture(scope="module")
def pair() -> Iterator[Any]:
    from zerobridge.harness.cluster import Cluster

    with Cluster(2, timeout_s=180) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def uninterrupted(pair: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each backend's run from step 0 to ``STEPS`` with nothing in its way (its checkpoints kept)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    runs = {}
    for backend in BACKENDS:
        result = pair.run(f"{FAULTS}:run", root=str(root / backend), backend=backend, steps=STEPS,
                          save_every=SAVE_EVERY)[0]
        runs[backend] = {"weights": result["weights"], "root": root / backend}
    return runs


def same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"not bit-identical to the uninterrupted run: {different}"


# ----------------------------------------------------------------------------------------- a rank killed

@pytest.mark.parametrize("where", list(KILL_AT))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_rank_resumes_bit_identical(pair: Any, uninterrupted: dict[str, Any], tmp_path: Path,
                                             backend: str, where: str) -> None:
    from zerobridge.harness.cluster import RankError

    kill = KILL_AT[where]
    with pytest.raises(RankError, match="signal 9|died|killed"):
        pair.run(f"{FAULTS}:run", root=str(tmp_path), backend=backend, steps=STEPS, save_every=SAVE_EVERY,
                 kill=kill)
    expected = 4 if backend == "deepspeed-api" and where == "save-swap" else RESUMED_FROM[kill]
    if backend != "deepspeed-api":
        assert latest_checkpoint(tmp_path) == tmp_path / f"step-{expected}"
    result = pair.run(f"{FAULTS}:run", root=str(tmp_path), backend=backend, steps=STEPS, save_every=SAVE_EVERY)[0]
    assert result["resumed_from"] == expected
    same_weights(result["weights"], uninterrupted[backend]["weights"])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "a save left its staging directory"


# ----------------------------------------------------------------------------------------- a full disk

def _tmpfs(where: Path) -> bool:
    """A 4 MiB tmpfs at ``where`` where this machine lets us mount one (root, not in a locked container)."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_disk_fails_the_save_cleanly(pair: Any, uninterrupted: dict[str, Any], tmp_path: Path,
                                            backend: str) -> None:
    """The save after step 8 finds the disk full (a real tmpfs filled up, or an injected ENOSPC where none can
    be mounted): every rank gets a ``CheckpointError`` (an ``Exception``) naming the checkpoint, the ranks and
    the OS error; the staging directory is gone, step 4 verifies; with space freed the run saves again and
    ends bit-identical."""
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk)
    try:
        results = pair.run(f"{FAULTS}:run_disk_full", root=str(disk), backend=backend, steps=STEPS,
                           save_every=SAVE_EVERY, fill=mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    print(f"\n{backend}: disk full by {'a filled tmpfs' if mounted else 'an injected ENOSPC'}")
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None and error["caught_as_exception"], (rank, error)
        assert error["type"] == "CheckpointError", (rank, error)
        text = error["text"]
        assert "step-8" in text and "No space left on device" in text and "untouched" in text, text
        assert "rank" in text and "fix:" in text and "free space" in text, text
        assert "Traceback" not in text and len(text) < 800, text
    first = results[0]
    assert first["staging_left"] is False and first["previous_verifies"] is True
    same_weights(first["weights"], uninterrupted[backend]["weights"])


# ----------------------------------------------------------------------------------------- damaged checkpoints

def _copy(uninterrupted: dict[str, Any], backend: str, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ckpts"
    shutil.copytree(uninterrupted[backend]["root"], root)
    ckpt = root / "step-8"
    shard = max(ckpt.glob("__*_0.distcp"), key=lambda p: p.stat().st_size)
    return ckpt, shard


def _flip(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    for at in range(len(data) // 2, len(data) // 2 + 8):
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["native", "fsdp"])
@pytest.mark.parametrize("damage", ["flipped", "truncated", "flipped, no manifest", "truncated, no manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(pair: Any, uninterrupted: dict[str, Any], tmp_path: Path,
                                                         backend: str, damage: str) -> None:
    ckpt, shard = _copy(uninterrupted, backend, tmp_path)
    if damage.startswith("flipped"):
        _flip(shard)
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    if "no manifest" in damage:
        (ckpt / MANIFEST).unlink()
    results = pair.run(f"{FAULTS}:load_damaged", path=str(ckpt), backend=backend)
    for error in results:
        assert error is not None and error["type"] == "CheckpointError", error
        text = error["text"]
        assert "fix:" in text and "Traceback" not in text, text
        if "no manifest" in damage:
            assert f"no {MANIFEST}" in text and "verify=False" in text and str(ckpt) in text, text
        else:
            assert shard.name in text, text  # the file, not only the keys
    if "no manifest" not in damage:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert latest_checkpoint(ckpt.parent) == ckpt.parent / "step-4"  # the damaged newest is skipped
        assert any(shard.name in str(w.message) for w in seen), [str(w.message) for w in seen]
    if damage == "truncated, no manifest":  # read unchecked on request: the read error names the shard
        unchecked = pair.run(f"{FAULTS}:load_damaged", path=str(ckpt), backend=backend, verify=False)
        assert all(e is not None and shard.name in e["text"] for e in unchecked), unchecked


# ----------------------------------------------------------------------------------------- leftovers

def test_a_save_removes_what_killed_saves_left_and_reports_live_ones(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A stale ``.NAME.saving`` (no process holds its lock) goes at the next save into the same folder, under any
    name; one a live save holds stays and is reported; ``checkpoint info`` on the folder lists them."""
    from zerobridge.checkpoint.portable import PortableState, write_portable
    from zerobridge.cli import main

    state = PortableState(model={"w": torch.ones(3)})
    stale, live = saving_dir(tmp_path / "step-8"), saving_dir(tmp_path / "step-10")
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 100)
    live.mkdir()
    holder = StagingLock(live)
    assert holder.acquire()
    try:
        assert [(p.name, held) for p, held in leftovers(tmp_path)] == [(live.name, True), (stale.name, False)]
        assert main(["checkpoint", "info", str(tmp_path)]) == 0
        shown = capsys.readouterr().out
        assert f"leftover     {stale.name}: left by a save that never finished" in shown, shown
        assert f"leftover     {live.name}: a save is writing it" in shown, shown
        with pytest.warns(UserWarning) as seen:
            write_portable(tmp_path / "step-12", state)
        said = " ".join(str(w.message) for w in seen)
        assert f"removed {stale.name}" in said and f"left {live.name}" in said, said
        assert not stale.exists() and live.exists()
    finally:
        holder.release()


def test_latest_checkpoint_prefers_latest_then_the_newest_manifest(tmp_path: Path) -> None:
    from zerobridge.checkpoint.portable import PortableState, write_portable

    for step in (4, 8, 12):
        write_portable(tmp_path / f"step-{step}", PortableState(model={"w": torch.full((2,), float(step))}))
    newest = (tmp_path / "step-12" / MANIFEST).stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "step-4" / MANIFEST, ns=(newest, newest))  # written last: the newest manifest
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    (tmp_path / "latest").write_text("step-8", encoding="utf-8")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-8"
    saving_dir(tmp_path / "step-16").mkdir()  # a save that never finished is no checkpoint
    assert latest_checkpoint(tmp_path / "nowhere") is None


# ----------------------------------------------------------------------------------------- a launcher restart

def test_zerobridge_run_max_restarts_comes_back(uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    """One launch, every backend in turn: on attempt k, rank 1 of the k-th backend's run dies mid-step 6;
    ``zerobridge run --max-restarts 3`` restarts both workers each time (a fresh rendezvous store: the dead
    attempt's addresses would refuse the connection), and each run resumes from its step 4 and ends
    bit-identical to its uninterrupted run."""
    out = tmp_path / "final.pt"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": "1"}
    backends = [flag for backend in BACKENDS for flag in ("--backend", backend)]
    proc = subprocess.run([sys.executable, "-m", "zerobridge.cli", "run", "--nproc", "2", "--max-restarts",
                           str(len(BACKENDS)), "-m", FAULTS, "--root", str(tmp_path / "ckpts"), *backends,
                           "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--kill", "step:6",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "connectFullMesh" not in proc.stderr
    final = torch.load(out, weights_only=True)
    assert sorted(final) == sorted(BACKENDS)
    for index, backend in enumerate(BACKENDS):
        got = final[backend]
        # the last attempt resumed every run: the ones killed earlier from the step 8 they saved after resuming
        expected = 4 if index == len(BACKENDS) - 1 else 8
        assert (got["attempt"], got["resumed_from"]) == (len(BACKENDS), expected), (backend, got["resumed_from"])
        same_weights(got["weights"], uninterrupted[backend]["weights"])
