"""A process group spawned once that runs many cases.

Example (save as a script: "spawn" re-imports the main module, so guard it)::

    from zerobridge.harness.cluster import Cluster

    if __name__ == "__main__":
        with Cluster(2) as cluster:
            print(cluster.run("zerobridge.harness.probes:all_reduce_sum", value=1.5))
            # [3.0, 3.0]

``Cluster(world_size)`` starts ``world_size`` worker processes with the
multiprocessing "spawn" context (never fork). Each worker sets the usual
launcher variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), initialises the default ``torch.distributed`` group and then
waits on its own task queue. ``run("package.module:function", **kwargs)`` calls
``function(**kwargs)`` on every rank and returns the results in rank order.

Any failure (a rank raising, a rank dying, a timeout) raises :class:`RankError`
and tears the workers down, because the surviving ranks may be stuck half way
through a collective; the next ``run`` starts a fresh set transparently.

Protocol: tasks are ``("run", task_id, target, pickled_kwargs)`` or
``("stop",)``; results are ``(rank, task_id, ok, payload)`` on one shared
queue, where ``payload`` is the pickled return value when ``ok`` and the
formatted traceback text otherwise. Task id ``-1`` is the start-up report.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, NoReturn

__all__ = ["Cluster", "RankError", "clusters"]

_READY = -1  # task id of the start-up report each worker sends after init
_STARTUP_MIN_S = 60.0  # importing torch in a fresh process can be slow
_GRACE_S = 2.0  # after one rank fails, how long to wait for the others
_POLL_S = 0.1


class RankError(RuntimeError):
    """One or more ranks failed, died or did not answer in time.

    ``ranks`` are the rank numbers at fault; ``tracebacks`` maps each rank that
    raised to its remote traceback text, which the message includes verbatim.
    """

    def __init__(self, message: str, ranks: tuple[int, ...], tracebacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.tracebacks = dict(tracebacks or {})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _resolve(target: str) -> Callable[..., object]:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _exit_now(results: Queue[Any], code: int) -> NoReturn:
    """Flush what was sent, then exit skipping interpreter shutdown (gloo may abort there)."""
    try:
        results.close()
        results.join_thread()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _worker_main(
    rank: int, world_size: int, port: int, timeout_s: float, backend: str | None,
    env: dict[str, str], tasks: Queue[Any], results: Queue[Any],
) -> None:
    """Body of one worker process: init the group, then serve tasks until stop."""
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
    })
    parent = os.getppid()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        chosen = backend
        if chosen is None:
            cuda = os.environ.get("ZEROBRIDGE_TEST_DEVICE") == "cuda" and torch.cuda.is_available()
            chosen = "nccl" if cuda else "gloo"
        if chosen == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            chosen, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except BaseException:
        results.put((rank, _READY, False, traceback.format_exc()))
        _exit_now(results, 1)
    results.put((rank, _READY, True, pickle.dumps(os.getpid())))
    while True:
        try:
            message = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died: nobody will send stop
                _exit_now(results, 1)
            continue
        if message[0] == "stop":
            break
        _, task_id, target, raw_kwargs = message
        payload: bytes | str  # the pickled value, or the traceback of what was raised
        try:
            value = _resolve(target)(**pickle.loads(raw_kwargs))
            ok, payload = True, pickle.dumps(value)
        except KeyboardInterrupt:
            raise
        except BaseException:  # SystemExit too: report it, keep serving
            ok, payload = False, traceback.format_exc()
        results.put((rank, task_id, ok, payload))
    with suppress(BaseException):
        dist.destroy_process_group()
    _exit_now(results, 0)


class Cluster:
    """``world_size`` spawned workers sharing one default process group.

    ``timeout_s`` bounds each :meth:`run`; ``group_timeout_s`` (default: the
    same) is the process-group timeout, after which a collective whose peers
    never come raises in the worker;
    start-up may take up to ``max(timeout_s, 60)`` seconds. ``backend`` is
    passed to ``init_process_group``; without it a worker uses "nccl" when
    ``ZEROBRIDGE_TEST_DEVICE=cuda`` and CUDA is available, else "gloo".
    ``env`` is added to each worker's environment (the launcher variables
    above take precedence).
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, group_timeout_s: float | None = None,
                 backend: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.group_timeout_s = float(group_timeout_s if group_timeout_s is not None else timeout_s)
        self.backend = backend
        self.env = dict(env or {})
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._tasks: list[Queue[Any]] = []
        self._results: Queue[Any] | None = None
        self._next_id = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, in rank order ([] when stopped)."""
        return [int(p.pid or 0) for p in self._procs]

    def start(self) -> None:
        """Spawn the workers and wait until every rank joined the group (no-op if running)."""
        if self._procs:
            return
        port = _free_port()
        self._results = self._ctx.Queue()
        for rank in range(self.world_size):
            tasks: Queue[Any] = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_worker_main, name=f"zerobridge-rank{rank}", daemon=True,
                args=(rank, self.world_size, port, self.group_timeout_s, self.backend, self.env, tasks, self._results),
            )
            self._tasks.append(tasks)
            self._procs.append(proc)
            proc.start()
        try:
            self._collect(_READY, max(self.timeout_s, _STARTUP_MIN_S), "start-up")
        except BaseException:
            self._teardown()
            raise

    def run(self, target: str, /, **kwargs: object) -> list[object]:
        """Call ``target`` ("package.module:function") with ``kwargs`` on every
        rank; return the per-rank results in rank order or raise RankError."""
        module_name, sep, attr = target.partition(":")
        if not (module_name and sep and attr):
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        raw_kwargs = pickle.dumps(kwargs)  # fails here, not silently in a feeder thread
        self.start()
        task_id = self._next_id
        self._next_id += 1
        try:
            for tasks in self._tasks:
                tasks.put(("run", task_id, target, raw_kwargs))
            return self._collect(task_id, self.timeout_s, target)
        except BaseException:
            self._teardown()  # survivors may be half way through a collective
            raise

    def _collect(self, task_id: int, timeout_s: float, what: str) -> list[object]:
        """Wait for every rank's answer to ``task_id``; raise RankError unless all succeeded."""
        assert self._results is not None
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, tid, ok, payload = self._results.get(timeout=min(_POLL_S, remaining))
            except queue.Empty:
                if any(r not in got and not p.is_alive() for r, p in enumerate(self._procs)):
                    self._drain(task_id, got)  # a dead rank may have answered first
                    break
                continue
            if tid != task_id:
                continue  # stale answer to an earlier task
            got[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        values: list[object] = []
        failed: dict[int, str] = {r: str(p) for r, (ok, p) in sorted(got.items()) if not ok}
        if not failed and len(got) == self.world_size:
            for rank in range(self.world_size):
                try:
                    values.append(pickle.loads(got[rank][1]))
                except Exception:
                    failed[rank] = f"could not unpickle the result in the parent:\n{traceback.format_exc()}"
            if not failed:
                return values
        lines = [f"rank {r} failed in {what}:\n{tb.rstrip(chr(10))}" for r, tb in failed.items()]
        missing = [r for r in range(self.world_size) if r not in got]
        for rank in missing:
            proc = self._procs[rank]
            proc.join(timeout=0.05)
            code = proc.exitcode
            state = f"still running after {timeout_s:g} s" if code is None and not failed else (
                "still running" if code is None else
                f"killed by signal {-code}" if code < 0 else f"process exited with code {code}")
            lines.append(f"rank {rank} did not answer {what} ({state})")
        ranks = tuple(sorted(set(failed) | set(missing)))
        raise RankError(f"{len(ranks)} of {self.world_size} rank(s) failed: {list(ranks)}\n" + "\n".join(lines),
                        ranks, failed)

    def _drain(self, task_id: int, got: dict[int, tuple[bool, Any]]) -> None:
        while self._results is not None:
            try:
                rank, tid, ok, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                return
            if tid == task_id:
                got[rank] = (ok, payload)

    def _teardown(self) -> None:
        """Kill whatever workers are left and drop the queues."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
            with suppress(ValueError):  # still running after kill + join: leave it to the OS
                proc.close()  # release its handles now, not at interpreter exit
        for q in [*self._tasks, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results = [], [], None

    def close(self) -> None:
        """Ask every worker to stop, wait briefly, kill leftovers. Idempotent;
        worker exit codes are ignored (gloo may abort at interpreter exit)."""
        if not self._procs:
            return
        for proc, tasks in zip(self._procs, self._tasks):
            if proc.is_alive():
                with suppress(OSError, ValueError):
                    tasks.put(("stop",))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._teardown()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def clusters(*sizes: int, timeout_s: float = 120) -> Iterator[dict[int, Cluster]]:
    """One ``Cluster`` per world size in ``sizes`` (a test module's fixture), all closed at the end."""
    made: dict[int, Cluster] = {}
    try:
        for n in sizes:
            made[n] = Cluster(n, timeout_s=timeout_s)
        yield made
    finally:
        for cluster in made.values():
            cluster.close()
