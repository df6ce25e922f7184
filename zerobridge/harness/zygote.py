"""Start worker programs in a blink: fork them from a process that has already imported torch.

    import os
    from zerobridge.harness.zygote import start_module

    worker = start_module("http.server", env=dict(os.environ))   # as `python -m http.server`, forked
    worker.pid, worker.poll()                                     # (12345, None): running
    worker.kill(); worker.wait(timeout=5.0)                       # -9

Every ``Cluster`` start used to pay a fresh interpreter importing torch on
each rank: 3 to 5 s of both cores on a 2-core machine, for every comparison
run and every test module that starts a group. A *zygote* is one long-lived
program (``python -m zerobridge.harness.zygote``) that imports ``torch`` and
``torch.distributed`` (and any modules its requester names) once and then waits; each worker is a ``fork`` of it
that runs its module as ``python -m MODULE`` would (``runpy``, as ``__main__``).

What a worker gets is what ``subprocess.Popen`` of ``python -m MODULE`` gave it:

- the environment and working folder of the request, not the zygote's;
- the requester's standard output and error, passed over the socket
  (``SCM_RIGHTS``) at each request, so a worker's prints go where the
  requester's go *now* (pytest's capture included); its input is ``/dev/null``;
- its exit code, reported back by the zygote, which reaps it
  (``Worker.poll``/``wait`` as ``Popen``'s; a kill shows as ``-9``).

The zygote never runs a torch operation and never touches CUDA, so the fork
is safe: it has one thread, and CUDA is initialised in the worker if at all.
Variables torch may read as it is imported (``TORCH_*``, ``PYTORCH_*``,
``CUDA_*``, ``OMP_*``, ``MKL_*``, ``KMP_*``, ``NCCL_*``, ``PYTHON*``, ``LD_*``, and DeepSpeed's
``DS_*`` for a zygote that preloads it) pick the
zygote: a request whose values differ gets a zygote of its own. When its
requester exits (the socket closes) the zygote exits, and its workers, which
watch their parent, follow.

``ZEROBRIDGE_CLUSTER_START=spawn`` (or a platform without ``fork`` or
``socket.send_fds``) makes ``forking()`` false: the caller then starts a fresh
interpreter instead (``Cluster`` does).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from typing import Any

__all__ = ["Worker", "forking", "start_module"]

_IMPORT_TIME = ("TORCH", "PYTORCH", "CUDA", "OMP", "MKL", "KMP", "NCCL", "PYTHON", "LD_", "DS_")
"""Prefixes of the variables that pick a zygote (torch or the interpreter may read them at import)."""
_MESSAGE = 65536


def forking() -> bool:
    """Whether workers are forked from a zygote here (else each is a fresh interpreter)."""
    return (os.environ.get("ZEROBRIDGE_CLUSTER_START", "fork") != "spawn" and hasattr(os, "fork")
            and hasattr(socket, "send_fds") and sys.platform.startswith("linux"))


class Worker:
    """One worker program: a ``Popen`` (started fresh) or a fork of a zygote, with ``Popen``'s
    ``pid``, ``poll``, ``wait``, ``kill`` and ``returncode``."""

    def __init__(self, pid: int, zygote: _Zygote | None = None, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self._zygote = zygote
        self._proc = proc

    @property
    def returncode(self) -> int | None:
        """The exit code once it ended (negative: the signal that killed it), else ``None``."""
        return self.poll()

    def poll(self) -> int | None:
        """The exit code if it ended, else ``None``."""
        if self._proc is not None:
            return self._proc.poll()
        assert self._zygote is not None
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self._proc is not None:
            return self._proc.wait(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        """SIGKILL it (nothing if it already ended)."""
        if self._proc is not None:
            self._proc.kill()
        elif self.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class _Zygote:
    """The requester's side of one zygote: spawn requests and the exit codes it reports."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen([sys.executable, "-m", "zerobridge.harness.zygote", str(theirs.fileno()),
                                       *preload], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._replies: list[int] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name="zerobridge-zygote").start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._replies.append(-1)
                    self._changed.notify_all()
                    return
                kind, pid, *code = data.decode().split()
                if kind == "pid":
                    self._replies.append(int(pid))
                else:
                    self._exits[int(pid)] = int(code[0])
                self._changed.notify_all()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def spawn(self, module: str, env: dict[str, str]) -> int:
        """Fork one worker running ``module`` with ``env``, this folder, and this process's stdout and
        stderr; its pid."""
        request = json.dumps({"module": module, "env": env, "cwd": os.getcwd()}).encode()
        with self._lock, self._changed:
            socket.send_fds(self._sock, [request], [sys.stdout.fileno() if _has_fd(sys.stdout) else 1,
                                                    sys.stderr.fileno() if _has_fd(sys.stderr) else 2])
            if not self._changed.wait_for(lambda: bool(self._replies), timeout=60.0):
                raise RuntimeError("the zygote did not answer a start request in 60 s")
            pid = self._replies.pop(0)
        if pid < 0:
            raise RuntimeError("the zygote exited before it started the worker")
        return pid


def _has_fd(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


_zygotes: dict[tuple[str, ...], _Zygote] = {}
_zygotes_lock = threading.Lock()


def _key(env: dict[str, str], preload: tuple[str, ...]) -> tuple[str, ...]:
    return (*preload, "", *sorted(f"{k}={v}" for k, v in env.items() if k.startswith(_IMPORT_TIME)))


def start_module(module: str, env: dict[str, str], preload: tuple[str, ...] = ()) -> Worker:
    """``python -m module`` with ``env``, forked from a zygote whose import-time environment matches
    ``env`` and that imported ``torch``, ``torch.distributed`` and the modules ``preload`` names (started on
    first use; a module that fails to import there is left for the worker to import). Only where ``forking()``."""
    key = _key(env, preload)
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive():
            zygote = _zygotes[key] = _Zygote(env, preload)
    return Worker(zygote.spawn(module, env), zygote)


# ------------------------------------------------------------------------------------------- the zygote


def _serve(sock: socket.socket) -> None:
    """Fork a worker per request until the requester goes; report each worker's exit code."""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                sock.send(f"exit {pid} {code}".encode())
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 2)
        if not message:
            os._exit(0)  # the requester is gone; the workers see their parent go and stop
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            _become_worker(sock, fds, request)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(f"pid {pid}".encode())


def _become_worker(sock: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
    """In the fork: take the request's streams, folder and environment, then serve as a worker."""
    code = 1
    try:
        sock.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [request["module"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os._exit(code)


def _zygote_main(fd: int, preload: list[str]) -> None:
    import torch  # lazy: the zygote's whole point, what every worker would import first, done once
    import torch.distributed  # noqa: F401

    for name in preload:
        with suppress(Exception):  # the worker imports it again and meets the error where it is reported
            importlib.import_module(name)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the requester
    _serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]), sys.argv[2:])
