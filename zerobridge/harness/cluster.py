"""A process group started once that runs many cases.

Example (a plain script; no ``if __name__ == "__main__":`` guard needed)::

    from zerobridge.harness.cluster import Cluster

    with Cluster(2) as cluster:
        print(cluster.run("zerobridge.harness.probes:all_reduce_sum", value=1.5))
        # [3.0, 3.0]

``Cluster(world_size)`` starts ``world_size`` worker programs,
``python -m zerobridge.harness.cluster``: fresh interpreters that import only
zerobridge and the targets they are asked to run, never the caller's script
(so no multiprocessing "spawn" re-import of ``__main__``). They get the
caller's ``sys.path``, so a target in a test module resolves there as well.
Each worker sets the usual launcher variables (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), initialises the default
``torch.distributed`` group, connects back to the parent (a local socket,
authenticated with a random key) and then waits for tasks.
``run("package.module:function", **kwargs)`` calls ``function(**kwargs)`` on
every rank and returns the results in rank order.

Any failure (a rank raising, a rank dying, a timeout) raises :class:`RankError`
and tears the workers down, because the surviving ranks may be stuck half way
through a collective; the next ``run`` starts a fresh set transparently.

Protocol: tasks are ``("run", task_id, target, pickled_kwargs)`` or
``("stop",)``; each rank answers ``(rank, task_id, ok, payload)`` on its own
connection, where ``payload`` is the pickled return value when ``ok`` and the
formatted traceback text otherwise. Task id ``-1`` is the start-up report.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, NoReturn

from zerobridge.backends.deepspeed.extensions import same_ninja
from zerobridge.harness.zygote import Worker, forking, start_module

__all__ = ["PRELOAD", "Cluster", "RankError", "clusters"]

_READY = -1  # task id of the start-up report each worker sends after init
_STARTUP_MIN_S = 60.0  # importing torch in a fresh process can be slow
_GRACE_S = 2.0  # after one rank fails, how long to wait for the others
_POLL_S = 0.1
_ENV = "ZEROBRIDGE_CLUSTER"  # the worker's settings: address, key, rank, world, timeouts, backend, sys.path


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
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _resolve(target: str) -> Callable[..., object]:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


PRELOAD = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo")
"""What a forked worker finds imported besides torch: the DTensor and FSDP modules (2-4 s of import on a
busy 2-core machine) that every engine of zerobridge's loads, and dynamo, which torch imports on the
first random initialisation under a device context (about 1 s of a tiny run)."""


def _start(env: dict[str, str], preload: tuple[str, ...]) -> Worker:
    """One worker program with ``env``: forked from a zygote that has imported torch and ``preload``
    (``zygote``), or a fresh interpreter where forking is off."""
    if forking():
        return start_module("zerobridge.harness.cluster", env, preload)
    proc = subprocess.Popen([sys.executable, "-m", "zerobridge.harness.cluster"], env=env)
    return Worker(proc.pid, proc=proc)


def _exit_now(code: int) -> NoReturn:
    """Exit skipping interpreter shutdown (gloo may abort there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker_main() -> None:
    """Body of one worker program: init the group, connect to the parent, serve tasks until stop."""
    settings = json.loads(os.environ.pop(_ENV))
    rank, world_size = int(settings["rank"]), int(settings["world_size"])
    sys.path[:] = [*settings["sys_path"], *(p for p in sys.path if p not in settings["sys_path"])]
    conn: Connection = Client((settings["host"], int(settings["listen"])), authkey=bytes.fromhex(settings["key"]))
    parent = os.getppid()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        chosen = settings["backend"]
        if chosen is None:
            cuda = os.environ.get("ZEROBRIDGE_TEST_DEVICE") == "cuda" and torch.cuda.is_available()
            chosen = "nccl" if cuda else "gloo"
        if chosen == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(chosen, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=float(settings["group_timeout_s"])))
    except BaseException:
        conn.send((rank, _READY, False, traceback.format_exc()))
        _exit_now(1)
    conn.send((rank, _READY, True, pickle.dumps(os.getpid())))
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # the parent died: nobody will send stop
                    _exit_now(1)
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed the connection
            _exit_now(1)
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
        conn.send((rank, task_id, ok, payload))
    with suppress(BaseException):
        dist.destroy_process_group()
    conn.close()
    _exit_now(0)


class Cluster:
    """``world_size`` worker programs sharing one default process group.

    ``timeout_s`` bounds each :meth:`run`; ``group_timeout_s`` (default: the
    same) is the process-group timeout, after which a collective whose peers
    never come raises in the worker;
    start-up may take up to ``max(timeout_s, 60)`` seconds. ``backend`` is
    passed to ``init_process_group``; without it a worker uses "nccl" when
    ``ZEROBRIDGE_TEST_DEVICE=cuda`` and CUDA is available, else "gloo".
    ``env`` is added to each worker's environment (the launcher variables
    above take precedence). ``preload`` names modules a forked worker finds
    already imported (default ``PRELOAD``): a caller that runs the same target
    in many groups names that target's module, which must not read the
    environment as it is imported.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, group_timeout_s: float | None = None,
                 backend: str | None = None,
                 env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.group_timeout_s = float(group_timeout_s if group_timeout_s is not None else timeout_s)
        self.backend = backend
        self.env = dict(env or {})
        self.preload = preload
        self._procs: list[Worker] = []
        self._conns: dict[int, Connection] = {}
        self._listener: Listener | None = None
        self._next_id = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, in rank order ([] when stopped)."""
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Start the workers and wait until every rank joined the group (no-op if running)."""
        if self._procs:
            return
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, listen = self._listener.address
        port = _free_port()
        accepted: list[Connection] = []
        threading.Thread(target=self._accept, args=(self._listener, accepted), daemon=True).start()
        for rank in range(self.world_size):
            settings = {"host": host, "listen": listen, "key": key.hex(), "rank": rank, "world_size": self.world_size,
                        "group_timeout_s": self.group_timeout_s, "backend": self.backend, "sys_path": sys.path}
            env = {**os.environ, **self.env, _ENV: json.dumps(settings),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(self.world_size)}
            same_ninja(env)  # a worker that builds a DeepSpeed op uses the ninja every process here uses
            self._procs.append(_start(env, self.preload))
        try:
            self._collect(_READY, max(self.timeout_s, _STARTUP_MIN_S), "start-up", accepted)
        except BaseException:
            self._teardown()
            raise

    def _accept(self, listener: Listener, accepted: list[Connection]) -> None:
        """Take each worker's connection as it comes (a thread: accept has no timeout)."""
        while len(accepted) < self.world_size:
            try:
                accepted.append(listener.accept())
            except Exception:  # the listener closed (teardown), or a stranger failed the key
                if self._listener is not listener:
                    return

    def run(self, target: str, /, **kwargs: object) -> list[object]:
        """Call ``target`` ("package.module:function") with ``kwargs`` on every
        rank; return the per-rank results in rank order or raise RankError."""
        module_name, sep, attr = target.partition(":")
        if not (module_name and sep and attr):
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        raw_kwargs = pickle.dumps(kwargs)  # fails here, not half way through sending
        self.start()
        task_id = self._next_id
        self._next_id += 1
        try:
            for conn in self._conns.values():
                conn.send(("run", task_id, target, raw_kwargs))
            return self._collect(task_id, self.timeout_s, target)
        except BaseException:
            self._teardown()  # survivors may be half way through a collective
            raise

    def _collect(self, task_id: int, timeout_s: float, what: str,
                 accepted: list[Connection] | None = None) -> list[object]:
        """Wait for every rank's answer to ``task_id``; raise RankError unless all succeeded.
        At start-up, ``accepted`` fills with the connections as the workers make them."""
        got: dict[int, tuple[bool, Any]] = {}
        open_: list[Connection] = [] if accepted is not None else list(self._conns.values())
        taken = 0  # of ``accepted``
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if accepted is not None:
                fresh, taken = accepted[taken:], taken + len(accepted[taken:])
                open_.extend(fresh)
            for conn in wait(open_, timeout=min(_POLL_S, remaining)) if open_ else ():
                assert isinstance(conn, Connection)
                try:
                    rank, tid, ok, payload = conn.recv()
                except (EOFError, OSError):  # its worker died: nothing more will come
                    open_.remove(conn)
                    continue
                if accepted is not None:
                    self._conns[rank] = conn
                if tid != task_id:
                    continue  # stale answer to an earlier task
                got[rank] = (ok, payload)
                if not ok:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
            if not open_ and accepted is None:
                break
            if any(r not in got and p.poll() is not None for r, p in enumerate(self._procs)) and \
                    not any(c.poll() for c in open_):
                break  # a rank died and nothing it sent first is left to read
            if not open_:
                time.sleep(_POLL_S)
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
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
            code = proc.returncode
            state = f"still running after {timeout_s:g} s" if code is None and not failed else (
                "still running" if code is None else
                f"killed by signal {-code}" if code < 0 else f"process exited with code {code}")
            lines.append(f"rank {rank} did not answer {what} ({state})")
        ranks = tuple(sorted(set(failed) | set(missing)))
        raise RankError(f"{len(ranks)} of {self.world_size} rank(s) failed: {list(ranks)}\n" + "\n".join(lines),
                        ranks, failed)

    def _teardown(self) -> None:
        """Kill whatever workers are left and drop the connections."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            with suppress(subprocess.TimeoutExpired):  # still running after kill + wait: leave it to the OS
                proc.wait(timeout=5.0)
        for conn in self._conns.values():
            conn.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            import socket

            with suppress(OSError), socket.create_connection(listener.address, timeout=1.0):
                pass  # wakes a thread still waiting in accept: it fails the key and sees the listener gone
            listener.close()
        self._procs, self._conns = [], {}

    def close(self) -> None:
        """Ask every worker to stop, wait briefly, kill leftovers. Idempotent;
        worker exit codes are ignored (gloo may abort at interpreter exit)."""
        if not self._procs:
            return
        for proc, conn in zip(self._procs, [self._conns.get(r) for r in range(len(self._procs))]):
            if proc.poll() is None and conn is not None:
                with suppress(OSError, ValueError):
                    conn.send(("stop",))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
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


if __name__ == "__main__":
    _worker_main()
