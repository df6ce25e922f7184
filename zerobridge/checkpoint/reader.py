"""Reading a checkpoint: verify the files, read DCP's metadata safely, copy boxes out.

    >>> import tempfile, pathlib, torch
    >>> from zerobridge.checkpoint.layout import Box, whole
    >>> from zerobridge.checkpoint.writer import Piece, write_checkpoint
    >>> from zerobridge.checkpoint.reader import Target, open_checkpoint
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> w = torch.arange(12.0).reshape(3, 4)
    >>> pieces = [Piece("model.w", Box((0, 0), (2, 4)), (3, 4), torch.float32, lambda: w[:2]),   # two chunks
    ...           Piece("model.w", Box((2, 0), (1, 4)), (3, 4), torch.float32, lambda: w[2:])]
    >>> write_checkpoint(path, pieces, [], saved={}, distributed=False)
    >>> ckpt = open_checkpoint(path)
    >>> out = torch.zeros(2, 2)
    >>> ckpt.read([Target("model.w", Box((1, 1), (2, 2)), out)])   # spans both chunks
    >>> out.tolist()
    [[5.0, 6.0], [9.0, 10.0]]

``open_checkpoint`` checks every file against ``zerobridge.json`` before
anything is parsed (a DCP directory without one, e.g. from an FSDP2 job, is
read unverified, with a warning), then reads ``.metadata`` with the
restricted unpickler. ``read`` intersects each wanted box with the saved
chunks, whatever layout wrote them, and lets DCP's ``FileSystemReader`` copy
the overlaps (tensor items: ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from zerobridge.checkpoint.layout import ZB, Box, intersect, whole
from zerobridge.checkpoint.storage import (
    MANIFEST,
    METADATA_FILE,
    CheckpointError,
    checkpoint_kind,
    read_manifest,
    recover,
    verify_files,
)
from zerobridge.checkpoint.unpickle import decode_bytes, read_metadata
from zerobridge.distributed import host_world

__all__ = ["Checkpoint", "Target", "open_checkpoint"]


@dataclass(frozen=True)
class Target:
    """Where the values of ``box`` of saved tensor ``key`` go (``dest`` has ``box.sizes``)."""

    key: str
    box: Box
    dest: torch.Tensor


class _Planner(LoadPlanner):
    """Hands DCP's reader the destination of each read and decodes byte items safely."""

    def __init__(self, dests: dict[str, torch.Tensor], source: str) -> None:
        self.dests = dests
        self.source = source
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.values[key] = decode_bytes(value, source=self.source, key=key)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.dests[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, offset, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class Checkpoint:
    """A checkpoint whose files were verified and whose metadata was read safely."""

    def __init__(self, path: Path, metadata: Metadata, manifest: dict[str, Any] | None,
                 recovered: str | None = None) -> None:
        self.path = path
        self.metadata = metadata
        self.manifest = manifest
        """``None`` for a DCP directory without ``zerobridge.json`` (read unverified)."""
        self.recovered = recovered
        """What ``recover`` did to an interrupted save, if anything."""
        self.reader = FileSystemReader(path)
        self.reader.set_up_storage_reader(metadata, False)
        self.paths: dict[str, tuple[Any, ...]] = dict(metadata.planner_data or {}) \
            if isinstance(metadata.planner_data, dict) else {}

    @property
    def source(self) -> str:
        return str(self.path / METADATA_FILE)

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def __iter__(self) -> Iterator[str]:
        """The keys, in the order ``keys()`` lists them: ``for key in ckpt`` as for a mapping."""
        return iter(self.keys())

    def tensor(self, key: str) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(key)
        return md if isinstance(md, TensorStorageMetadata) else None

    def is_bytes(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), BytesStorageMetadata)

    def _run(self, items: list[ReadItem], planner: _Planner, what: str) -> None:
        if not items:
            return
        try:
            self.reader.read_data(LoadPlan(items), planner).wait()
        except CheckpointError:
            raise
        except Exception as exc:  # a damaged file in a directory without a manifest
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            files = self._files(items)
            where = self.path / files[0] if len(files) == 1 else self.path
            held = f" (held in {', '.join(files)})" if len(files) > 1 else ""
            raise CheckpointError(f"cannot read {what}{held}: {type(exc).__name__}: {first}", source=where,
                                  fix="the data files are damaged: restore the checkpoint from a good copy") from None

    def _files(self, items: list[ReadItem]) -> list[str]:
        """The data files that hold ``items``, by DCP's storage index."""
        storage = self.metadata.storage_data if isinstance(self.metadata.storage_data, dict) else {}
        names = {getattr(storage.get(item.storage_index), "relative_path", None) for item in items}
        return sorted(n for n in names if isinstance(n, str))

    def read(self, targets: list[Target]) -> None:
        """Fill every target from the saved chunks that overlap its box."""
        items, dests = [], {}
        for n, target in enumerate(targets):
            md = self.tensor(target.key)
            if md is None:
                raise CheckpointError("is not a tensor in this checkpoint", source=self.source, key=target.key,
                                      fix="check the key (zerobridge checkpoint info lists them)")
            covered = 0
            for c, chunk in enumerate(md.chunks):
                saved = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                common = intersect(target.box, saved)
                if common is None:
                    continue
                dest = f"{n}"
                dests[dest] = target.dest
                items.append(ReadItem(
                    type=LoadItemType.TENSOR, dest_index=MetadataIndex(dest, common.offsets),
                    dest_offsets=torch.Size(o - b for o, b in zip(common.offsets, target.box.offsets)),
                    storage_index=MetadataIndex(target.key, saved.offsets, c),
                    storage_offsets=torch.Size(o - s for o, s in zip(common.offsets, saved.offsets)),
                    lengths=torch.Size(common.sizes)))
                covered += common.numel
            if covered != target.box.numel:
                raise CheckpointError(f"its chunks cover {covered} of the {target.box.numel} elements of box "
                                      f"{target.box.offsets}+{target.box.sizes}: the metadata is incomplete",
                                      source=self.source, key=target.key, fix="restore the checkpoint from a good copy")
        self._run(items, _Planner(dests, self.source), ", ".join(sorted({t.key for t in targets})[:3]))

    def full(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A saved tensor, whole."""
        md = self.tensor(key)
        if md is None:
            raise CheckpointError("is not a tensor in this checkpoint", source=self.source, key=key,
                                  fix="check the key (zerobridge checkpoint info lists them)")
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        self.read([Target(key, whole(tuple(md.size)), out)])
        return out if dtype is None else out.to(dtype)

    def read_bytes(self, keys: list[str]) -> dict[str, Any]:
        """Plain values of byte items, loaded with ``weights_only=True``."""
        items = []
        for key in keys:
            if not self.is_bytes(key):
                raise CheckpointError("is not a plain value in this checkpoint", source=self.source, key=key,
                                      fix="check the key (zerobridge checkpoint info lists them)")
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]),
                                  storage_index=index, storage_offsets=torch.Size([0]), lengths=torch.Size([0])))
        planner = _Planner({}, self.source)
        self._run(items, planner, ", ".join(keys[:3]))
        return planner.values


def _verify(path: Path, manifest: dict[str, Any], distributed: bool) -> None:
    """Each rank checks a share of the files; every rank raises the first problem found."""
    if not distributed or dist.get_world_size() == 1:
        verify_files(path, manifest)
        return
    names = sorted(manifest["files"])
    problem: tuple[str, str | None, str | None, str | None] | None = None
    try:
        verify_files(path, manifest, names[dist.get_rank()::dist.get_world_size()])
    except CheckpointError as exc:
        problem = (exc.message, exc.source, exc.key, exc.fix)
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem, group=host_world())
    first = next((p for p in found if p is not None), None)
    if first is not None:
        message, source, key, fix = first
        raise CheckpointError(message, source=source, key=key, fix=fix)


def _unverified(path: Path, metadata: Metadata, verify: bool) -> None:
    """A DCP directory without ``zerobridge.json``: FSDP2's or ``dcp.save``'s (read with a warning), or a zerobridge
    checkpoint that lost its manifest (its own ``zerobridge.*`` keys): refused unless ``verify`` is off."""
    ours = any(key.startswith(f"{ZB}.") for key in metadata.state_dict_metadata)
    if ours and verify:
        raise CheckpointError(f"holds zerobridge's keys but no {MANIFEST}: its files cannot be checked, so a "
                              "damaged shard would load as wrong weights", source=path,
                              fix=f"restore {MANIFEST} from the copy the checkpoint came from, or load it unchecked "
                                  "with load_checkpoint(..., verify=False)")
    what = (f"a zerobridge checkpoint without its {MANIFEST}" if ours
            else "written by torch.distributed.checkpoint (FSDP2, dcp.save), not zerobridge")
    warnings.warn(f"{path} has no {MANIFEST} ({what}): its files are read unchecked", stacklevel=4)


def open_checkpoint(path: str | Path, *, distributed: bool = False, verify: bool = True) -> Checkpoint:
    """Recover an interrupted swap, verify every file, read the metadata; collective when ``distributed``.

    ``verify=False`` reads without checking files against ``zerobridge.json``, and
    reads a zerobridge checkpoint whose manifest was lost (with a warning); by
    default such a directory is refused: nothing could tell a damaged file."""
    path = Path(path).absolute()
    parallel = distributed and dist.is_initialized() and dist.get_world_size() > 1
    recovered = None
    if not parallel or dist.get_rank() == 0:
        recovered = recover(path)
    if parallel:
        dist.barrier(group=host_world())
    kind = checkpoint_kind(path)
    manifest = None
    if kind == "zerobridge":
        manifest = read_manifest(path)
        if verify:
            _verify(path, manifest, parallel)
    with (path / METADATA_FILE).open("rb") as fh:
        metadata = read_metadata(fh, str(path / METADATA_FILE))
    if kind == "dcp":
        _unverified(path, metadata, verify)
    listed = set(manifest["files"]) if manifest is not None else None
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else None
    if storage is None:
        raise CheckpointError("has no storage index (not written by DCP's FileSystemWriter)",
                              source=path / METADATA_FILE, fix="point at a directory written by dcp.save or zerobridge")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        ok = isinstance(name, str) and "/" not in name and "\\" not in name and name not in ("", ".", "..")
        if (not ok or (listed is not None and name not in listed)
                or (listed is None and not (path / str(name)).is_file())):
            raise CheckpointError(f"points {getattr(index, 'fqn', index)!r} at {name!r}, which is not a "
                                  f"{'file the manifest lists' if listed is not None else 'file of this directory'}",
                                  source=path / METADATA_FILE, fix="restore the checkpoint from a good copy")
    return Checkpoint(path, metadata, manifest, recovered)
