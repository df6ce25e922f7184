"""Writing a checkpoint: a DCP save plan of boxes that are read only when written.

    >>> import tempfile, pathlib, torch
    >>> from zerobridge.checkpoint.layout import whole
    >>> from zerobridge.checkpoint.writer import Blob, Piece, write_checkpoint
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> w = torch.arange(6.0).reshape(2, 3)
    >>> write_checkpoint(path, [Piece("model.w", whole((2, 3)), (2, 3), torch.float32, lambda: w)],
    ...                  [Blob("zerobridge.layout", {"world_size": 1})], saved={"world_size": 1}, distributed=False)
    >>> sorted(p.name for p in path.iterdir())
    ['.metadata', '__0_0.distcp', 'zerobridge.json']

A ``Piece`` is one box of one key with a function that produces its values;
DCP calls ``resolve_data`` item by item while it writes, so a rank holds one
run's values at a time (state kept in files is read there, not before).
Every rank writes its own ``__<rank>_<i>.distcp`` (several files, one per
writer thread, once a rank has ``THREADED_BYTES`` to write) and hashes them
itself; rank 0 writes ``.metadata``, collects the digests, writes the
manifest and swaps the directory into place (``storage.py``). The wait for
the slowest rank's digests scales with the bytes a rank writes
(``save_timeout``): a 70B save with optimizer state takes longer than a
fixed collective timeout.
"""

from __future__ import annotations

import datetime
import errno
import io
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from zerobridge.checkpoint.layout import Box, key_path
from zerobridge.checkpoint.storage import (
    METADATA_FILE,
    CheckpointError,
    StagingLock,
    digest_files,
    recover,
    saving_dir,
    swap_into_place,
    sweep_stale,
    write_manifest,
)
from zerobridge.distributed import group_timeout, host_world

__all__ = ["THREADED_BYTES", "WRITER_THREADS", "Blob", "Piece", "RunCache", "save_failed", "save_timeout",
           "write_checkpoint", "writer_threads"]

WRITER_THREADS = 4
"""Files (and threads) per rank for a large save: DCP writes them in parallel."""
THREADED_BYTES = 256 << 20
"""A rank with fewer bytes to write writes one file."""
SLOWEST_BYTES_PER_S = 16 << 20
"""The slowest write-and-hash rate a save waits for (a busy network file system)."""


def writer_threads(nbytes: int) -> int:
    """Writer threads (and files) for a rank that writes ``nbytes``."""
    return WRITER_THREADS if nbytes >= THREADED_BYTES else 1


def save_timeout(nbytes: int) -> datetime.timedelta:
    """How long ranks wait for the slowest one, which writes and hashes ``nbytes``: the
    group timeout plus ``nbytes`` at ``SLOWEST_BYTES_PER_S``."""
    return group_timeout() + datetime.timedelta(seconds=nbytes / SLOWEST_BYTES_PER_S)


@dataclass(frozen=True)
class Piece:
    """One box of one tensor key, produced on demand (``fetch`` returns ``box.sizes`` values)."""

    key: str
    box: Box
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]
    fqn: str | None = None
    """The parameter name inside an ``optim.state`` key (it may hold dots)."""

    @property
    def whole(self) -> bool:
        return self.box.sizes == self.shape


@dataclass(frozen=True)
class Blob:
    """A plain value (numbers, strings, lists, tuples, dicts, tensors), stored with ``torch.save``."""

    key: str
    value: Any
    checked: bool = False
    """The value was checked to read back under ``weights_only`` (``run_state.check_loadable``): any
    container it holds is allowed, not only the plain values a hyperparameter may be."""


class RunCache:
    """Keeps the last value loaded, so the boxes of one run read it once."""

    def __init__(self) -> None:
        self._tag: object = None
        self._value: Any = None

    def get(self, tag: object, load: Callable[[], Any]) -> Any:
        if self._tag != tag:
            self._tag, self._value = None, None  # drop the previous run before reading the next
            self._value, self._tag = load(), tag
        return self._value


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


class _Planner(DefaultSavePlanner):
    """DCP's default global planning (dedup, metadata, overlap and coverage checks)
    over items this planner makes itself."""

    def __init__(self, pieces: list[Piece], blobs: list[Blob]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.lock = threading.Lock()  # writer threads call resolve_data at once; fetches share RunCaches
        self.pieces = {MetadataIndex(p.key, p.box.offsets): p for p in pieces}
        self.blobs = {MetadataIndex(b.key): b for b in blobs}
        self.paths = {p.key: key_path(p.key, p.fqn) for p in pieces}
        self.paths.update({b.key: key_path(b.key) for b in blobs})
        for blob in blobs:
            if not blob.checked and not _plain(blob.value):
                raise CheckpointError(f"holds a {type(blob.value).__name__}, which a checkpoint cannot store "
                                      "as a plain value", key=blob.key,
                                      fix="keep optimizer hyperparameters to numbers, strings, tuples and tensors")

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.mappings = self.paths
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for index, piece in self.pieces.items():
            data = TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(piece.box.offsets),
                                                              sizes=torch.Size(piece.box.sizes)),
                                   properties=TensorProperties(dtype=piece.dtype), size=torch.Size(piece.shape))
            kind = WriteItemType.TENSOR if piece.whole else WriteItemType.SHARD
            items.append(WriteItem(index=index, type=kind, tensor_data=data))
        items += [WriteItem(index=index, type=WriteItemType.BYTE_IO) for index in self.blobs]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        index = MetadataIndex(write_item.index.fqn, write_item.index.offset)
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.blobs[index].value, buffer)
            buffer.seek(0)
            return buffer
        piece = self.pieces[index]
        with self.lock:
            value = piece.fetch()
            if tuple(value.shape) != piece.box.sizes:
                raise AssertionError(f"{piece.key}: box {piece.box} got values of shape {tuple(value.shape)}")
            return value.detach().to(device="cpu", dtype=piece.dtype)


def agree(distributed: bool, error: BaseException | None, value: Any = None, *,
          timeout: datetime.timedelta | None = None) -> list[Any]:
    """Raise on every rank when one failed (rank 0 finishes a save alone), else return every
    rank's ``value``. Over the host group (gloo), whatever the default group's backend;
    ``timeout``: wait that long for the other ranks (a monitored barrier first)."""
    mine = (None if error is None else str(error), value)
    found: list[Any] = [mine]
    if distributed and dist.get_world_size() > 1:
        group = host_world()
        if timeout is not None:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine, group=group)
    if error is not None:
        raise error
    first = next((text for text, _ in found if text is not None), None)
    if first is not None:
        raise CheckpointError(f"another rank failed: {first}", fix="see that rank's error")
    return [v for _, v in found]


def _failed_ranks(exc: BaseException) -> tuple[list[int], str]:
    """The ranks a DCP ``CheckpointException`` names and the first cause, in one line (an ``OSError``'s
    ``[Errno 28] No space left on device``, not the per-rank tracebacks DCP's message carries)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [], (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    causes = []
    for wrapped in failures.values():
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        text = f"{type(cause).__name__}: {cause}" if not isinstance(cause, OSError) else (
            f"[Errno {cause.errno}] {cause.strerror}" if cause.errno is not None else str(cause))
        if text not in causes:
            causes.append(text)
    return sorted(int(r) for r in failures), "; ".join(causes)


def save_failed(path: Path, exc: BaseException, *, staged_removed: bool) -> CheckpointError:
    """What a save that failed while writing says, on every rank: the checkpoint, the ranks, the OS error,
    that the previous checkpoint is untouched, and the fix."""
    ranks, cause = _failed_ranks(exc)
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed: " if ranks else ""
    previous = ("the previous checkpoint there is untouched" if path.exists()
                else f"nothing was written under {path.name}; earlier checkpoints beside it are untouched")
    cleaned = "the half-written save was removed" if staged_removed else \
        f"remove the half-written {saving_dir(path).name} beside it"
    disk = "No space left" in cause or "Disk quota" in cause
    fix = (f"free space on {path.parent} ({cleaned}) or save elsewhere, then save again" if disk
           else f"check permissions and the file system under {path.parent} ({cleaned}), then save again")
    return CheckpointError(f"cannot save: {who}{cause}; {previous}", source=path, fix=fix)


def _abandon(staged: Path, lock: StagingLock | None) -> bool:
    """Rank 0, after a failed save: remove the staging directory; whether it is gone."""
    if lock is not None:
        lock.release()
    shutil.rmtree(staged, ignore_errors=True)
    return not staged.exists()


def write_checkpoint(path: Path, pieces: list[Piece], blobs: list[Blob], *, saved: dict[str, Any],
                     distributed: bool = True) -> None:
    """Write a DCP checkpoint of ``pieces`` and ``blobs`` at ``path``, atomically.

    Collective when ``distributed`` (every rank of the default group calls it
    with its own pieces); ``saved`` goes into the manifest. Any failure is a
    ``CheckpointError`` on every rank (``save_failed``), after rank 0 removed the
    staging directory; the checkpoint already at ``path`` stays. Staging
    directories that killed saves left in the parent are removed first
    (``storage.sweep_stale``)."""
    path = Path(path).absolute()
    staged = saving_dir(path)
    rank = dist.get_rank() if distributed else 0
    error: BaseException | None = None
    lock: StagingLock | None = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            recover(path)
            if staged.exists():  # a save that was killed: never complete, never the checkpoint
                shutil.rmtree(staged)
            for line in sweep_stale(path.parent, keep=staged):
                warnings.warn(f"{path.parent}: {line}", stacklevel=3)
            staged.mkdir()
            lock = StagingLock(staged)
            if not lock.acquire():
                raise OSError(errno.EBUSY, "another process is saving to the same path", str(staged))
        except OSError as exc:
            error = CheckpointError(f"cannot prepare the save ({exc})", source=staged,
                                    fix="check permissions and free space")
    nbytes = sum(p.box.numel * p.dtype.itemsize for p in pieces)
    patience = save_timeout(max(agree(distributed, error, nbytes)))
    writer = FileSystemWriter(staged, single_file_per_rank=True, sync_files=True,
                              thread_count=writer_threads(nbytes), overwrite=True)
    swapped = abandoned = False
    try:
        try:
            with warnings.catch_warnings():  # no_dist: DCP warns that it saves in one process, as asked
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_save({}, storage_writer=writer, planner=_Planner(pieces, blobs), no_dist=not distributed,
                         process_group=host_world() if distributed else None)
        except (CheckpointException, OSError) as exc:  # DCP raises on every rank when any rank failed to write
            removed = abandoned = _abandon(staged, lock) if rank == 0 else True
            raise save_failed(path, exc, staged_removed=removed) from None
        digests: dict[str, Any] = {}
        try:  # each rank hashes the files it wrote; rank 0 also DCP's metadata
            mine = [f.name for f in staged.glob(f"__{rank}_*.distcp")] + ([METADATA_FILE] if rank == 0 else [])
            digests = digest_files(staged, mine, threads=WRITER_THREADS)
        except OSError as exc:
            error = save_failed(path, exc, staged_removed=True)
        found = agree(distributed, error, digests, timeout=patience)
        if rank == 0:
            try:
                write_manifest(staged, saved, {name: entry for part in found for name, entry in part.items()})
                swap_into_place(staged, path)
                swapped = True
            except OSError as exc:
                error = save_failed(path, exc, staged_removed=True)
        agree(distributed, error)
    except BaseException:
        if rank == 0 and not swapped and not abandoned:  # never leave a half-written save behind
            _abandon(staged, lock)
        raise
    finally:
        if lock is not None:
            lock.release()
