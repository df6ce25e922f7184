"""Reading DCP's pickled parts without running arbitrary code.

    >>> import io, os, pickle
    >>> from zerobridge.checkpoint.unpickle import read_metadata
    >>> class Evil:
    ...     def __reduce__(self):
    ...         return (os.system, ("echo pwned",))
    >>> try:
    ...     read_metadata(io.BytesIO(pickle.dumps(Evil())), "ckpt/.metadata")
    ... except ValueError as exc:
    ...     print(str(exc).split(":")[:2])
    ['ckpt/.metadata', ' refuses to unpickle posix.system']

DCP's ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``, which runs
whatever callable the file names. Here an ``Unpickler`` resolves only DCP's
metadata classes, ``torch.Size``, dtypes, layouts and paths; anything else is
refused before it is called. Tensor items are read by DCP with
``torch.load(weights_only=True)``; byte items (hyperparameters, zerobridge's
extras) go through ``decode_bytes``, the same restricted loader.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from zerobridge.checkpoint.storage import CheckpointError

__all__ = ["decode_bytes", "read_metadata"]

_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # a path string, never touched on disk
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    pass


def read_metadata(stream: IO[bytes], source: str) -> Metadata:
    """DCP's ``Metadata`` from an open ``.metadata`` file; anything else refused."""
    try:
        value = _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise CheckpointError(f"refuses to unpickle {exc}: DCP metadata holds only metadata classes, sizes and "
                              "dtypes, so this file was altered or is not a DCP checkpoint", source=source,
                              fix="restore the checkpoint from a trusted copy; "
                                  "never load it with plain pickle") from None
    except Exception as exc:  # truncated or garbage: pickle raises many kinds
        raise CheckpointError(f"cannot read the DCP metadata ({type(exc).__name__}: {exc})", source=source,
                              fix="the file is damaged: restore the checkpoint from a good copy") from None
    if not isinstance(value, Metadata) or not isinstance(value.state_dict_metadata, dict):
        raise CheckpointError(f"holds a {type(value).__name__}, not DCP metadata", source=source,
                              fix="point at a directory written by torch.distributed.checkpoint or zerobridge")
    return value


def decode_bytes(value: io.BytesIO, *, source: str, key: str) -> Any:
    """A byte item (``torch.save`` of plain values) loaded with ``weights_only=True``."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read this item with torch.load(weights_only=True): {first}", source=source,
                              key=key, fix="only plain values (numbers, strings, lists, tuples, dicts, tensors) "
                              "are read back; restore the checkpoint from a trusted copy") from None
