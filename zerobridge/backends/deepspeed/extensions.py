"""Where DeepSpeed builds its ops, settled before DeepSpeed starts: once per user and torch version.

DeepSpeed compiles its C++ ops (the CPU accelerator's shared-memory comm op,
FusedAdam, ...) on first use into ``TORCH_EXTENSIONS_DIR``; torch's default is
a folder under ``/tmp`` that a reboot or a fresh container empties, so the
first DeepSpeed run pays the build again (minutes on 2 CPU cores). Unset,
``extensions_dir`` makes it ``~/.cache/zerobridge/torch_extensions/torch-<version>``
(``$XDG_CACHE_HOME`` when set): one folder per user and torch version, built
once.

Every build in a folder must use one ninja. A virtual environment holds its
own (``pip install deepspeed`` pulls the ``ninja`` package, 1.13 today) beside
the system's (1.11 on Debian 12), and a process finds whichever comes first on
``PATH``: ``.venv/bin/python train.py`` the system's, an activated environment
or a ``torchrun`` from it the environment's. The two versions hash the build
commands differently, so each sees the other's objects as built by another
command and rebuilds every op (a minute or more each on 2 cores), at every
switch. ``extensions_dir`` puts the interpreter's own folder first on ``PATH``
when it holds a ``ninja``, so every process of one environment builds with the
same one (``same_ninja``).

A build holds ``<dir>/<op>/lock`` while ninja runs in ``<dir>/<op>``; an
interrupted build (Ctrl-C, a timeout) leaves the file behind and every later
DeepSpeed start waits on it forever, printing nothing. ``stale_locks`` finds
the ones no process is building under: older than ``LIVE_S`` and no process
with its working directory or an open file in that folder. ``extensions_dir``
removes them with a warning that names the file.

``build_ops`` compiles the ops a DeepSpeed run here uses, once, ahead of a
launch (``zerobridge build-ops``), the way ``DS_BUILD_OPS=1 pip install
deepspeed`` does at install time: otherwise the first rank to need an op
builds it while every other rank waits on its lock, inside the launcher's
timeouts.

    >>> import tempfile, pathlib, os, time
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> (root / "fused_adam").mkdir(); (root / "fused_adam" / "lock").touch()
    >>> old = time.time() - 2 * LIVE_S
    >>> os.utime(root / "fused_adam" / "lock", (old, old))
    >>> [p.relative_to(root).as_posix() for p in stale_locks(root)]
    ['fused_adam/lock']
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError

__all__ = ["LIVE_S", "OPS", "OpBuild", "build_ops", "default_dir", "extensions_dir", "same_ninja", "stale_locks"]

LIVE_S = 120.0
"""A lock younger than this may belong to a build that has not started ninja yet: never stale."""


def default_dir() -> Path:
    """``~/.cache/zerobridge/torch_extensions/torch-<version>`` (``$XDG_CACHE_HOME`` for ``~/.cache``)."""
    import torch

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "zerobridge" / "torch_extensions" / f"torch-{torch.__version__}"


def _busy_folders() -> set[Path]:
    """The folders some process works in or holds a file open in (this user's processes: /proc)."""
    busy: set[Path] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return busy
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            busy.add(Path(os.readlink(pid / "cwd")))
            for fd in (pid / "fd").iterdir():
                busy.add(Path(os.readlink(fd)).parent)
        except OSError:  # gone, or another user's
            continue
    return busy


def stale_locks(folder: Path) -> list[Path]:
    """``folder/<op>/lock`` files no live build holds: older than ``LIVE_S`` and no process in that op's folder."""
    locks = sorted(folder.glob("*/lock"))
    now = time.time()
    old = [lock for lock in locks if now - lock.stat().st_mtime > LIVE_S]
    if not old:
        return []
    busy = _busy_folders()
    return [lock for lock in old
            if not any(b == lock.parent or lock.parent in b.parents for b in busy)]


def same_ninja(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put this interpreter's folder first on ``environ``'s ``PATH`` when it holds a ``ninja`` (see the
    module docstring); whether ``PATH`` changed."""
    here = str(Path(sys.executable).parent)
    if not (Path(here) / "ninja").exists():
        return False
    parts = environ.get("PATH", "").split(os.pathsep)
    if parts[:1] == [here]:
        return False
    environ["PATH"] = os.pathsep.join([here, *(p for p in parts if p and p != here)])
    return True


def extensions_dir(environ: MutableMapping[str, str] = os.environ) -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` in ``environ`` when unset (``default_dir``), put this environment's ninja
    first on ``PATH`` (``same_ninja``) and remove the folder's stale build locks, each with a warning on
    stderr; the folder. Call it before DeepSpeed is imported."""
    same_ninja(environ)
    if not environ.get("TORCH_EXTENSIONS_DIR"):
        environ["TORCH_EXTENSIONS_DIR"] = str(default_dir())
    folder = Path(environ["TORCH_EXTENSIONS_DIR"])
    for lock in stale_locks(folder) if folder.is_dir() else []:
        try:
            lock.unlink()
        except FileNotFoundError:  # another rank removed it first
            continue
        print(f"zerobridge: warning: removed {lock}: a stale DeepSpeed build lock (no process is building in "
              f"{lock.parent}; an interrupted first start leaves one, and DeepSpeed would wait on it forever)",
              file=sys.stderr)
    return folder


OPS: dict[str, str] = {
    "shm_comm": "ShareMemCommBuilder",  # the CPU accelerator's shared-memory collectives: every CPU run
    "fused_adam": "FusedAdamBuilder",  # an "Adam"/"AdamW" optimizer section
    "cpu_adam": "CPUAdamBuilder",  # ZeRO-Offload of the optimizer (DeepSpeedCPUAdam)
    "cpu_adagrad": "CPUAdagradBuilder",  # Adagrad with the optimizer offloaded
}
"""The DeepSpeed ops a zerobridge run can load, by name: DeepSpeed's op builder class for each."""


@dataclass(frozen=True)
class OpBuild:
    """One op ``build_ops`` built or found built."""

    name: str
    """The key in ``OPS``."""
    seconds: float
    """Wall time to load it (the compile, when it was not built)."""
    built: bool
    """Whether it was compiled now (False: loaded from the folder)."""
    error: str = ""
    """Why it could not be built here (no compiler, not on this accelerator); "" when it loaded."""


def _build_one(accelerator: Any, folder: Path, name: str) -> OpBuild:
    builder = accelerator.create_op_builder(OPS[name])
    if builder is None:
        return OpBuild(name, 0.0, False, f"DeepSpeed's {accelerator._name} accelerator has no {OPS[name]}")
    built = not any((folder / builder.name).glob("*.so"))
    start = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # no compiler or headers: DeepSpeed cannot build it here
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return OpBuild(name, time.perf_counter() - start, False, lines[0])
    return OpBuild(name, time.perf_counter() - start, built)


def build_ops(names: Sequence[str] = (), environ: MutableMapping[str, str] = os.environ,
              jobs: int = 1) -> list[OpBuild]:
    """Compile (or load) DeepSpeed's ops ``names`` (default: every one in ``OPS`` this accelerator has) into
    ``extensions_dir(environ)``, ``jobs`` ops at a time; one ``OpBuild`` each, in order. An unknown name is a
    ``ConfigError``. One at a time is the default: ninja already compiles an op's sources in parallel, and
    on 2 cores two ops at once took longer (shm_comm, fused_adam and cpu_adam: 164.7 s against 139.8 s)."""
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise ConfigError(f"unknown DeepSpeed op {', '.join(map(repr, unknown))}", key="OP",
                          fix=f"name one of {', '.join(OPS)} (or none: every one this accelerator has)")
    folder = extensions_dir(environ)
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        raise ConfigError(f"DeepSpeed is not installed ({exc})", fix="pip install 'zerobridge[deepspeed]'") from None
    accelerator = get_accelerator()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # threads: each waits on its ninja subprocess
        return list(pool.map(lambda name: _build_one(accelerator, folder, name), names or list(OPS)))
