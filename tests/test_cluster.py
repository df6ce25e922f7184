"""zerobridge.harness.cluster: one process group of worker programs serving many runs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerobridge.harness import zygote
from zerobridge.harness.cluster import Cluster, RankError

PROBES = "zerobridge.harness.probes"


@pytest.fixture(scope="module")
def solo() -> Iterator[Cluster]:
    with Cluster(1, timeout_s=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pair() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=60) as cluster:
        yield cluster


def test_results_come_back_in_rank_order(pair: Cluster) -> None:
    infos = pair.run(f"{PROBES}:rank_info")
    assert [info["rank"] for info in infos] == [0, 1]  # type: ignore[index]
    assert [info["world_size"] for info in infos] == [2, 2]  # type: ignore[index]
    assert [info["backend"] for info in infos] == ["gloo", "gloo"]  # type: ignore[index]
    assert [info["pid"] for info in infos] == pair.pids  # type: ignore[index]


def test_all_reduce_sums_across_ranks(pair: Cluster, solo: Cluster) -> None:
    assert pair.run(f"{PROBES}:all_reduce_sum", value=1.25) == [2.5, 2.5]
    assert solo.run(f"{PROBES}:all_reduce_sum", value=1.25) == [1.25]


def test_workers_see_launcher_environment(pair: Cluster) -> None:
    assert pair.run("os:getenv", key="LOCAL_RANK") == ["0", "1"]
    assert pair.run("os:getenv", key="WORLD_SIZE") == ["2", "2"]
    assert pair.run("os:getenv", key="LOCAL_WORLD_SIZE") == ["2", "2"]
    assert pair.run("os:getenv", key="MASTER_ADDR") == ["127.0.0.1", "127.0.0.1"]


def test_many_runs_are_served_by_the_same_processes(pair: Cluster) -> None:
    pids = pair.pids
    assert len(pids) == 2 and len(set(pids)) == 2
    for i in range(20):
        assert pair.run(f"{PROBES}:all_reduce_sum", value=float(i)) == [2.0 * i, 2.0 * i]
    assert pair.pids == pids
    assert [info["pid"] for info in pair.run(f"{PROBES}:rank_info")] == pids  # type: ignore[index]


def test_remote_exception_becomes_rank_error_with_traceback(pair: Cluster) -> None:
    with pytest.raises(RankError) as info:
        pair.run(f"{PROBES}:fail_on", rank=1, message="deliberate failure 4711")
    err = info.value
    assert err.ranks == (1,)
    assert set(err.tracebacks) == {1}
    text = str(err)
    assert "rank 1" in text and "rank 0" not in text.split("\n", 1)[1]
    assert "Traceback (most recent call last):" in text
    assert "ValueError: deliberate failure 4711" in text
    assert 'probes.py", line' in text and "in fail_on" in text
    assert err.tracebacks[1].rstrip("\n") in text  # verbatim
    # the next run works (on a fresh group)
    assert pair.run(f"{PROBES}:fail_on", rank=5, message="never") == [0, 1]


def test_hard_exit_is_reported_and_the_next_run_gets_new_workers(pair: Cluster) -> None:
    old = pair.pids
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        pair.run(f"{PROBES}:exit_on", rank=1, code=7)
    assert time.monotonic() - started < 10
    assert info.value.ranks == (1,)
    assert "rank 1 did not answer" in str(info.value)
    assert "exited with code 7" in str(info.value)
    assert pair.pids == []  # torn down
    assert pair.run(f"{PROBES}:all_reduce_sum", value=3.0) == [6.0, 6.0]
    new = pair.pids
    assert len(new) == 2 and not set(new) & set(old)


def test_system_exit_and_unpicklable_results_are_failures(solo: Cluster) -> None:
    with pytest.raises(RankError, match="SystemExit"):
        solo.run("_thread:exit")
    with pytest.raises(RankError, match="pickle") as info:
        solo.run("threading:Lock")
    assert info.value.ranks == (0,)
    assert solo.run(f"{PROBES}:sleep_s", seconds=0.0) == [0]


def test_bad_target_is_rejected_without_breaking_the_cluster(solo: Cluster) -> None:
    pids = solo.pids
    with pytest.raises(ValueError, match="package.module:function"):
        solo.run("zerobridge.harness.probes.rank_info")
    assert solo.pids == pids
    with pytest.raises(RankError, match="ModuleNotFoundError"):
        solo.run("zerobridge.no_such_module:f")


def test_timeout_raises_rank_error() -> None:
    cluster = Cluster(1, timeout_s=3.0, env={"ZEROBRIDGE_PROBE_MARK": "on"})
    try:
        assert cluster.run("os:getenv", key="ZEROBRIDGE_PROBE_MARK") == ["on"]
        started = time.monotonic()
        with pytest.raises(RankError) as info:
            cluster.run(f"{PROBES}:sleep_s", seconds=30.0)
        elapsed = time.monotonic() - started
        assert 2.9 < elapsed < 8.0
        assert info.value.ranks == (0,)
        assert "rank 0 did not answer" in str(info.value)
        assert "still running after 3 s" in str(info.value)
        assert cluster.pids == []  # killed, not left sleeping
    finally:
        cluster.close()


def test_close_is_idempotent() -> None:
    cluster = Cluster(1)
    cluster.close()  # never started
    cluster.start()
    cluster.start()  # idempotent too
    pids = cluster.pids
    assert len(pids) == 1
    cluster.close()
    assert cluster.pids == []
    cluster.close()
    assert cluster.pids == []


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        Cluster(0)
    with pytest.raises(ValueError, match="timeout_s"):
        Cluster(1, timeout_s=0)


def test_a_plain_script_without_a_main_guard_starts_a_cluster(tmp_path: Path) -> None:
    """The workers are programs of their own (``python -m zerobridge.harness.cluster``): the caller's
    script is never imported again, so it needs no ``if __name__ == "__main__":`` guard."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text("from zerobridge.harness.cluster import Cluster\n"
                      "print('top level ran')\n"
                      "with Cluster(2) as cluster:\n"
                      f"    print(cluster.run('{PROBES}:all_reduce_sum', value=1.5))\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["top level ran", "[3.0, 3.0]"]  # once: no worker re-ran the script


# --------------------------------------------------------------- how workers start: forked from a zygote


def test_workers_are_forked_from_one_zygote_that_has_torch_loaded() -> None:
    """Forked workers come from one zygote (which imported torch once), the same for a second group."""
    if not zygote.forking():
        pytest.skip("this platform starts workers fresh (no fork or no socket.send_fds)")
    with Cluster(2, timeout_s=60) as first:
        parents = {info["parent"] for info in first.run(f"{PROBES}:start_info")}  # type: ignore[index]
    with Cluster(2, timeout_s=60) as second:
        infos = second.run(f"{PROBES}:start_info")
    assert {info["parent"] for info in infos} == parents and len(parents) == 1  # type: ignore[index]
    assert parents != {os.getpid()}
    assert all("zerobridge.harness.zygote" in info["parent_args"] for info in infos)  # type: ignore[index]


def test_spawn_mode_starts_fresh_interpreters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROBRIDGE_CLUSTER_START", "spawn")
    assert not zygote.forking()
    with Cluster(2, timeout_s=60) as cluster:
        infos = cluster.run(f"{PROBES}:start_info")
        assert cluster.run(f"{PROBES}:all_reduce_sum", value=0.5) == [1.0, 1.0]
    assert {info["parent"] for info in infos} == {os.getpid()}  # type: ignore[index]


def test_a_forked_worker_has_the_requests_folder_environment_and_streams(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    if not zygote.forking():
        pytest.skip("this platform starts workers fresh")
    monkeypatch.chdir(tmp_path)
    worker = zygote.start_module("zerobridge.harness.probes", {**os.environ, "PROBE_SAYS": "from the request"})
    assert worker.wait(timeout=30) == 0
    out = capfd.readouterr()
    assert f"probes as a program in {tmp_path} says from the request" in out.out
    assert "and to stderr" in out.err


def test_a_forked_workers_exit_code_and_kill_are_reported() -> None:
    if not zygote.forking():
        pytest.skip("this platform starts workers fresh")
    env = {**os.environ, "PROBE_EXIT": "7"}
    assert zygote.start_module("zerobridge.harness.probes", env).wait(timeout=30) == 7
    sleeper = zygote.start_module("zerobridge.harness.probes", {**os.environ, "PROBE_SLEEP_S": "60"})
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    assert sleeper.poll() is None
    sleeper.kill()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
