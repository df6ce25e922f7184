"""What a tensor holds on this rank: its local part and the storage behind it, asked the same way everywhere.

    >>> import torch
    >>> from zerobridge.runtime.tensors import StorageCounter, local_tensor, storage_key
    >>> a = torch.zeros(4); b = a[2:]                       # a view: the same storage
    >>> counter = StorageCounter()
    >>> counter.add([a, b]), counter.add([a]), counter.add([torch.zeros(2, dtype=torch.float64)])
    (16, 0, 16)
    >>> local_tensor(a) is a, storage_key(b) == storage_key(a)
    (True, True)

Under fake tensors (``zerobridge plan`` runs the engine on ``FakeTensorMode``)
no tensor holds values or an address: ``same_memory`` tells storages apart by
identity there, and ``host_flags`` reads every parameter as used and no step
as overflowed, the common case a plan is made for.

A ``DTensor`` (torch FSDP2's parameters, gradients and optimizer state) counts
by its local shard; a tensor whose storage was released (size 0) or that has
none of its own (some wrapper subclasses) counts nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["StorageCounter", "host_flags", "is_fake", "local_tensor", "same_memory", "storage_bytes", "storage_id",
           "storage_key"]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``FakeTensor`` (shapes and dtypes, no memory)."""
    return type(local_tensor(tensor)).__name__ == "FakeTensor"  # by name: fake_tensor is a heavy private import


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same memory (a copy between them does nothing)."""
    if is_fake(a) or is_fake(b):
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
    return a.data_ptr() == b.data_ptr()


def storage_id(tensor: torch.Tensor) -> int:
    """What tells ``tensor``'s storage from every other live one: its address, or under fake
    tensors (no addresses) the storage object's identity."""
    storage = local_tensor(tensor).untyped_storage()
    return int(storage._cdata) if is_fake(tensor) else int(storage.data_ptr())


def host_flags(flags: torch.Tensor, *, nonfinite_last: bool) -> list[float]:
    """``flags.tolist()``: the engine's one host read per step (used-parameter flags, then the
    overflow flag when ``nonfinite_last``). Fake tensors read as all used, no overflow."""
    if not is_fake(flags):
        return [float(v) for v in flags.tolist()]
    values = [1.0] * flags.numel()
    if nonfinite_last and values:
        values[-1] = 0.0
    return values


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard, else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)  # DTensor keeps its shard here (no import of DTensor needed)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of the storage behind ``tensor``'s local part; ``None`` when it holds
    no memory (released, meta, or a wrapper without storage of its own)."""
    try:
        nbytes = local_tensor(tensor).untyped_storage().nbytes()
        return (storage_id(tensor), nbytes) if nbytes else None
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
