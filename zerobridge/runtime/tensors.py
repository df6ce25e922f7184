"""What a tensor holds on this rank: its local part and the storage behind it, asked the same way everywhere.

    >>> import torch
    >>> from zerobridge.runtime.tensors import StorageCounter, local_tensor, storage_key
    >>> a = torch.zeros(4); b = a[2:]                       # a view: the same storage
    >>> counter = StorageCounter()
    >>> counter.add([a, b]), counter.add([a]), counter.add([torch.zeros(2, dtype=torch.float64)])
    (16, 0, 16)
    >>> local_tensor(a) is a, storage_key(b) == storage_key(a)
    (True, True)

A ``DTensor`` (torch FSDP2's parameters, gradients and optimizer state) counts
by its local shard; a tensor whose storage was released (size 0) or that has
none of its own (some wrapper subclasses) counts nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["StorageCounter", "local_tensor", "storage_bytes", "storage_key"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard, else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)  # DTensor keeps its shard here (no import of DTensor needed)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of the storage behind ``tensor``'s local part; ``None`` when it holds
    no memory (released, meta, or a wrapper without storage of its own)."""
    try:
        storage = local_tensor(tensor).untyped_storage()
        nbytes = storage.nbytes()
        return (storage.data_ptr(), nbytes) if nbytes else None
    except (RuntimeError, NotImplementedError):
        return None


def storage_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``tensor`` now (0 for ``None`` or a released storage)."""
    key = None if tensor is None else storage_key(tensor)
    return 0 if key is None else key[1]


class StorageCounter:
    """Bytes of distinct storages, each counted once however many tensors (views, tied names,
    several roles) point at it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Count the storages of ``tensors`` not counted before; return their bytes."""
        total = 0
        for tensor in tensors:
            key = None if tensor is None else storage_key(tensor)
            if key is not None and key[0] not in self.seen:
                self.seen.add(key[0])
                total += key[1]
        return total
