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
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["LIVE_S", "default_dir", "extensions_dir", "same_ninja", "stale_locks"]

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
