"""What a rank holds, measured the same way whatever engine runs: live tensor storages by role.

    >>> import torch
    >>> from zerobridge.compare.memory import live_by_role
    >>> model = torch.nn.Linear(4, 4)
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> model(torch.ones(2, 4)).sum().backward(); optimizer.step()
    >>> held = live_by_role(model, optimizer)
    >>> held["params"], held["grads"], held["optimizer"] >= 2 * held["params"]
    (80, 80, True)
    >>> from zerobridge.compare.memory import resident_bytes
    >>> from zerobridge.runtime.tensors import storage_key
    >>> bucket = torch.empty(2**26)                  # 256 MiB allocated, never written
    >>> resident_bytes(*storage_key(bucket)) < 2**24
    True

Every engine reports its own model-state bytes (``zerobridge.stats``), each
from its own accounting. This module counts instead every distinct tensor
storage the garbage collector can reach in the process, and names it by what
holds it: ``params`` (the storages ``model.parameters()`` reference, a
DTensor's local shard for FSDP2), ``grads`` (their ``.grad``), ``optimizer``
(the optimizer's state and the parameters it steps that the model does not
show, such as DeepSpeed's fp32 partitions), ``other`` (everything else:
engine buffers no parameter points at, activations, batches). A storage is
counted once, under the first role that claims it, however many tensors
(views into a flat buffer, tied names) point at it; storages are told apart
by their address.

A storage in host memory counts the bytes of it that lie on resident pages
(Linux ``mincore``): what the process holds of it, as its resident set counts
it. An allocation never written holds no memory there: DeepSpeed allocates
its stage-3 reduce bucket (``reduce_bucket_size`` elements, 5e8 unless the
config says less: 2 GB in fp32) whatever the model's size, and writes only
the gradients it reduces into it. Device memory (CUDA) is held as allocated,
so a device storage counts its allocated bytes, as does every storage where
residency cannot be asked.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from zerobridge.runtime.tensors import local_tensor, storage_key

__all__ = ["held_bytes", "live_by_role", "live_storages", "resident_bytes"]

_PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_LOW_BIT = bytes(b & 1 for b in range(256))
"""``mincore`` sets bit 0 of a page's byte when the page is resident; the other bits are reserved."""


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def resident_bytes(address: int, nbytes: int) -> int | None:
    """Bytes of ``[address, address + nbytes)`` that lie on pages resident in memory (Linux
    ``mincore``); None where residency cannot be asked (another system, an unmapped range)."""
    if _LIBC is None or nbytes <= 0:
        return None
    start, end = address - address % _PAGE, address + nbytes
    pages = -(-(end - start) // _PAGE)
    flags = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), flags) != 0:
        return None
    resident = bytes(flags).translate(_LOW_BIT)
    held = resident.count(1) * _PAGE
    if resident[0]:  # the first and last pages count only the part inside the range
        held -= address - start
    if resident[-1]:
        held -= start + pages * _PAGE - end
    return held


def held_bytes(tensor: torch.Tensor, key: tuple[int, int]) -> int:
    """What the process holds of the storage ``key`` behind ``tensor``: its resident bytes in host
    memory, its allocated bytes on a device (or where residency cannot be asked)."""
    if local_tensor(tensor).device.type == "cpu":
        resident = resident_bytes(*key)
        if resident is not None:
            return resident
    return key[1]


def live_storages() -> dict[int, int]:
    """Every distinct tensor storage the garbage collector can reach, by address: the bytes the
    process holds of it (``held_bytes``)."""
    found: dict[int, tuple[int, torch.Tensor]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:  # type(): no attribute lookups on the object
            key = storage_key(obj)
            if key is not None and key[1] > found.get(key[0], (0, obj))[0]:
                found[key[0]] = (key[1], obj)
    return {address: held_bytes(tensor, (address, size)) for address, (size, tensor) in found.items()}


def live_by_role(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of live storages on this process by role: ``params``, ``grads``, ``optimizer``, ``other``."""
    params = list(model.parameters())
    state = getattr(optimizer, "client", optimizer)  # zerobridge's DeepSpeed wrapper steps its client
    roles: dict[str, Sequence[torch.Tensor]] = {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": [*(_tensors(dict(state.state))),
                      *(p for g in state.param_groups for p in g["params"])],
    }
    claimed: dict[int, tuple[str, torch.Tensor, int]] = {}
    for role, tensors in roles.items():
        for tensor in tensors:
            key = storage_key(tensor)
            if key is not None and key[0] not in claimed:
                claimed[key[0]] = (role, tensor, key[1])
    held = {"params": 0, "grads": 0, "optimizer": 0, "other": 0}
    seen = live_storages()
    for address, size in seen.items():
        held[claimed[address][0] if address in claimed else "other"] += size
    for address, (role, tensor, size) in claimed.items():  # reachable only through C++ (a parameter's .grad)
        if address not in seen:
            held[role] += held_bytes(tensor, (address, size))
    return held
