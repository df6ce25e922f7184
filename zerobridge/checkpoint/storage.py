"""Checkpoint files on disk: the manifest, checks before reading, atomic replacement.

    >>> import tempfile, pathlib
    >>> from zerobridge.checkpoint.storage import write_manifest, read_manifest, verify_files
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / ".metadata").write_bytes(b"0123456789")
    >>> manifest = write_manifest(d, {"world_size": 1})
    >>> manifest["files"][".metadata"]["size"]
    10
    >>> _ = (d / ".metadata").write_bytes(b"01234")
    >>> try:
    ...     verify_files(d, read_manifest(d))
    ... except ValueError as exc:
    ...     print(str(exc).splitlines()[0].split(": ", 1)[1])
    is 5 bytes but zerobridge.json says 10: the file was truncated

A save writes into a sibling directory ``.<name>.saving``, which rank 0 holds
locked (``flock``) while it is written, fsyncs every
file, writes ``zerobridge.json`` (size and sha256 of every file) last, then
swaps the directory into place: ``renameat2(RENAME_EXCHANGE)`` where Linux
offers it, else old aside (``.<name>.old``), new in, old deleted. A kill at
any point leaves either the previous checkpoint or the new one under the
name; ``recover`` (run by every load and ``checkpoint info``) puts an aside
copy back when a kill landed between the two renames. A save that failed
removes its staging directory; one that was killed leaves it, unlocked, and
the next save into the same parent removes it (``sweep_stale``), while a
staging directory still locked by a live save is left alone and reported.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError

__all__ = ["FORMAT", "MANIFEST", "CheckpointError", "StagingLock", "aside_dir", "atomic_write_file",
           "checkpoint_kind", "digest_files", "latest_checkpoint", "leftovers", "read_manifest", "recover",
           "recover_all", "saving_dir", "sweep_stale", "swap_into_place", "verify_files", "write_manifest"]

MANIFEST = "zerobridge.json"
FORMAT = "zerobridge-checkpoint"
VERSION = 1
METADATA_FILE = ".metadata"
_CHUNK = 1 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read as asked: names the file, the key and the fix."""


def saving_dir(path: Path) -> Path:
    """Where a save writes before the swap."""
    return path.parent / f".{path.name}.saving"


_SAVING = re.compile(r"^\.(?P<name>.+)\.(saving|old)$")


class StagingLock:
    """An exclusive ``flock`` on a staging directory, held by the rank that saves for as long as
    the save runs: the kernel lets go of it when that process dies, so a staging directory
    nobody holds is a save that will never finish."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when a live process holds it."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def leftovers(parent: Path) -> list[tuple[Path, bool]]:
    """``(directory, live)`` for every staging (``.NAME.saving``) or aside (``.NAME.old``) directory in
    ``parent``: what interrupted saves left, ``live`` when a running save still holds it."""
    found = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if not entry.is_dir() or not _SAVING.match(entry.name):
            continue
        lock = StagingLock(entry)
        try:
            live = not lock.acquire()
        except OSError:  # gone meanwhile, or unreadable: report it as held, never remove it
            live = True
        lock.release()
        found.append((entry, live))
    return found


def sweep_stale(parent: Path, *, keep: Path) -> list[str]:
    """Remove the staging directories in ``parent`` that killed saves left (no live process holds
    their lock), except ``keep``; return a line per directory removed or left (still being written).
    An aside copy (``.NAME.old``) is ``recover``'s: put back or removed for its own checkpoint."""
    said = recover_all(parent)
    for entry, live in leftovers(parent):
        if entry == keep or entry.name.endswith(".old"):
            continue
        if live:
            said.append(f"left {entry.name}: another save is writing it")
            continue
        shutil.rmtree(entry, ignore_errors=True)
        said.append(f"removed {entry.name}, left by a save that never finished")
    return said


def aside_dir(path: Path) -> Path:
    """Where the previous checkpoint waits during a swap without RENAME_EXCHANGE."""
    return path.parent / f".{path.name}.old"


def _digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest_files(directory: Path, names: Iterable[str], *, threads: int = 4) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of files of ``directory``, hashed by several threads
    (hashlib lets go of the GIL on large blocks)."""
    ordered = sorted(names)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(ordered) or 1))) as pool:
        found = list(pool.map(lambda name: _digest(directory / name), ordered))
    return {name: {"size": size, "sha256": sha} for name, (size, sha) in zip(ordered, found)}


def write_manifest(directory: Path, saved: dict[str, Any], files: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """Write ``zerobridge.json`` (fsynced), last: ``files`` as hashed by the ranks that wrote
    them, or (``None``) every file of ``directory`` hashed here."""
    if files is None:
        names = [e.name for e in directory.iterdir() if e.name != MANIFEST and e.is_file()]
        files = digest_files(directory, names)
    files = dict(sorted(files.items()))
    manifest = {"format": FORMAT, "version": VERSION, "saved": saved, "files": files}
    target = directory / MANIFEST
    with target.open("w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(directory)
    return manifest


def checkpoint_kind(path: Path) -> str:
    """``"zerobridge"`` (a manifest), ``"dcp"`` (DCP metadata only, e.g. written by FSDP2), or a clear error
    (a DeepSpeed checkpoint directory: the ``zerobridge checkpoint import-deepspeed`` command that converts it)."""
    if not path.exists():
        raise CheckpointError("no such checkpoint", source=path,
                              fix="check the path; a save writes a directory there")
    if not path.is_dir():
        raise CheckpointError("is a file, not a checkpoint directory", source=path,
                              fix="pass the directory zerobridge.save_checkpoint or dcp.save wrote")
    if (path / MANIFEST).is_file():
        return "zerobridge"
    if (path / METADATA_FILE).is_file():
        return "dcp"
    _refuse_deepspeed(path)
    raise CheckpointError(f"holds neither {MANIFEST} nor {METADATA_FILE}: not a checkpoint (or a save never "
                          "finished)", source=path, fix="pass a directory written by zerobridge.save_checkpoint or "
                          "torch.distributed.checkpoint.save")


DEEPSPEED_LATEST = "latest"
"""The file DeepSpeed's ``save_checkpoint`` names the newest tag in."""


def _has_model_states(directory: Path) -> bool:
    return directory.is_dir() and any(directory.glob("*model_states.pt"))


def _step(tag: Path) -> tuple[int, str]:
    found = re.search(r"(\d+)$", tag.name)
    return (int(found.group(1)) if found else -1, tag.name)


def _refuse_deepspeed(path: Path) -> None:
    """A DeepSpeed save directory (``latest``, ``global_stepN/*model_states.pt``) or one tag directory: the
    ``zerobridge checkpoint import-deepspeed`` command that converts it. A ``latest`` naming a zerobridge
    checkpoint (``zerobridge.deepspeed``'s engine writes one): the directory to pass."""
    latest = path / DEEPSPEED_LATEST
    tag = latest.read_text(encoding="utf-8", errors="replace").strip() if latest.is_file() else ""
    if tag and (path / tag / MANIFEST).is_file():
        raise CheckpointError(f"is a save directory whose {DEEPSPEED_LATEST!r} names the checkpoint {tag!r}",
                              source=path, fix=f"load {path / tag}")
    command = None
    if _has_model_states(path) or (tag and _has_model_states(path / tag)):  # a tag directory, or what latest names
        command = f"{shlex.quote(str(path))} {shlex.quote(f'{path}-zerobridge')}"
    elif tags := sorted((t for t in path.iterdir() if _has_model_states(t)), key=_step):
        command = (f"{shlex.quote(str(path))} {shlex.quote(f'{path}-zerobridge')} "
                   f"--tag {shlex.quote(tags[-1].name)}")
    if command is not None:
        raise CheckpointError("is a DeepSpeed checkpoint (written by DeepSpeed's engine.save_checkpoint), not a "
                              "zerobridge one", source=path,
                              fix=f"convert it once with `zerobridge checkpoint import-deepspeed {command}` and "
                                  "load the result (model, optimizer, LR scheduler and client_state come along)")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked for shape."""
    source = path / MANIFEST
    try:
        manifest = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError("is missing", source=source, fix="pass a directory zerobridge.save_checkpoint "
                              "wrote, or restore the file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"is not valid JSON ({exc})", source=source,
                              fix="the manifest was altered or truncated: restore the checkpoint from a good copy"
                              ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"is not a zerobridge manifest (format {FORMAT!r} expected)", source=source,
                              key="format", fix="restore the checkpoint from a good copy")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"has version {manifest.get('version')!r}; this zerobridge reads {VERSION}",
                              source=source, key="version", fix="read it with the zerobridge that wrote it")
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise CheckpointError(f"must list every file with size and sha256, {METADATA_FILE} included",
                              source=source, key="files", fix="restore the checkpoint from a good copy")
    for name in files:
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"names {name!r}, which is not a file of this directory", source=source,
                                  key="files", fix="restore the checkpoint from a good copy")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], names: Iterable[str] | None = None) -> None:
    """Check size and sha256 of ``names`` (default: every listed file) before anything is read."""
    files = manifest["files"]
    for name in sorted(files if names is None else names):
        expected = files[name]
        target = path / name
        if not target.is_file():
            raise CheckpointError(f"is missing; {MANIFEST} lists it ({expected['size']} bytes)", source=target,
                                  fix="restore the whole checkpoint directory from a good copy")
        size = target.stat().st_size
        if size != expected["size"]:
            cause = "truncated" if size < expected["size"] else "extended"
            raise CheckpointError(f"is {size} bytes but {MANIFEST} says {expected['size']}: the file was {cause}",
                                  source=target, fix="restore the checkpoint from a good copy (an interrupted copy "
                                  "or a full disk does this)")
        _, sha = _digest(target)
        if sha != expected["sha256"]:
            raise CheckpointError(f"has sha256 {sha[:16]}... but {MANIFEST} says {expected['sha256'][:16]}...: "
                                  "the content was altered or corrupted", source=target,
                                  fix="restore the checkpoint from a good copy")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(staged: Path, path: Path) -> None:
    """Make ``staged`` (complete, manifest written) the checkpoint at ``path``."""
    if not path.exists():
        os.rename(staged, path)
    elif _exchange(staged, path):
        shutil.rmtree(staged)  # now the previous checkpoint
    else:
        aside = aside_dir(path)
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(path, aside)
        os.rename(staged, path)
        shutil.rmtree(aside)
    _fsync_path(path.parent)


def recover(path: Path) -> str | None:
    """Finish or undo a swap a kill interrupted; returns what was done, if anything."""
    aside = aside_dir(path)
    if not aside.exists():
        return None
    if path.exists():  # killed after the new checkpoint went in: the aside copy is stale
        shutil.rmtree(aside, ignore_errors=True)
        return f"removed {aside.name}, left by an interrupted save"
    try:
        os.rename(aside, path)  # killed between the renames: the previous checkpoint comes back
    except FileNotFoundError:  # another process recovered it first
        return None
    _fsync_path(path.parent)
    return f"restored the previous checkpoint from {aside.name} (a save was interrupted)"


def atomic_write_file(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a sibling temporary file, fsync, rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.saving"
    try:
        write(tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)


def _newest_first(parent: Path) -> list[Path]:
    """Checkpoint directories of ``parent`` (a manifest in them), the one named by ``parent/latest`` first, then by
    when their manifest was written, newest first (names break ties: ``step-10`` after ``step-9``)."""
    found = [e for e in parent.iterdir() if e.is_dir() and not e.name.startswith(".") and (e / MANIFEST).is_file()]
    found.sort(key=lambda e: ((e / MANIFEST).stat().st_mtime_ns, _step(e)), reverse=True)
    latest = parent / DEEPSPEED_LATEST
    tag = latest.read_text(encoding="utf-8", errors="replace").strip() if latest.is_file() else ""
    named = [e for e in found if e.name == tag]
    return named + [e for e in found if e.name != tag]


def latest_checkpoint(parent: str | Path) -> Path | None:
    """The newest complete checkpoint in ``parent`` whose every file matches its manifest, or ``None``.

    Where to resume after a restart: a save that never finished is not a
    checkpoint (it has no manifest under its name), and a damaged one
    (truncated, altered, a file missing) is skipped with a warning naming the
    file. ``parent/latest`` (what ``zerobridge.deepspeed``'s ``save_checkpoint``
    writes) names the one to take first; otherwise the newest manifest wins.
    Reads every file of the checkpoint it returns once (sha256); not collective:
    each rank may call it, and every rank gets the same answer while nothing
    writes to ``parent``.

        >>> import tempfile, pathlib
        >>> latest_checkpoint(pathlib.Path(tempfile.mkdtemp())) is None
        True
    """
    parent = Path(parent)
    if not parent.is_dir():
        return None
    recover_all(parent)
    for candidate in _newest_first(parent):
        try:
            verify_files(candidate, read_manifest(candidate))
        except CheckpointError as exc:
            warnings.warn(f"skipping {candidate}: {exc}", stacklevel=2)
            continue
        return candidate
    return None


def recover_all(parent: Path) -> list[str]:
    """``recover`` every checkpoint of ``parent`` whose swap a kill interrupted (an aside ``.NAME.old``)."""
    done = []
    for entry in parent.iterdir():
        found = _SAVING.match(entry.name)
        if found and entry.name.endswith(".old") and (line := recover(parent / found["name"])):
            done.append(line)
    return done
