"""What a rank holds, measured the same way whatever engine runs: live tensor storages by role.

    >>> import torch
    >>> from zerobridge.compare.memory import live_by_role
    >>> model = torch.nn.Linear(4, 4)
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> model(torch.ones(2, 4)).sum().backward(); optimizer.step()
    >>> held = live_by_role(model, optimizer)
    >>> held["params"], held["grads"], held["optimizer"] >= 2 * held["params"]
    (80, 80, True)

Every engine reports its own model-state bytes (``zerobridge.stats``), each
from its own accounting. This module counts instead every distinct tensor
storage the garbage collector can reach in the process, and names it by what
holds it: ``params`` (the storages ``model.parameters()`` reference, a
DTensor's local shard for FSDP2), ``grads`` (their ``.grad``), ``optimizer``
(the optimizer's state and the parameters it steps that the model does not
show, such as DeepSpeed's fp32 partitions), ``other`` (everything else:
engine buffers no parameter points at, activations, batches). A storage is
counted once, under the first role that claims it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from zerobridge.runtime.tensors import storage_key

__all__ = ["live_by_role", "live_storages"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def live_storages() -> dict[tuple[int, int], int]:
    """Every distinct tensor storage the garbage collector can reach: (address, bytes) to bytes."""
    found: dict[tuple[int, int], int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:  # type(): no attribute lookups on the object
            key = storage_key(obj)
            if key is not None:
                found[key] = key[1]
    return found


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
    claimed: dict[tuple[int, int], str] = {}
    for role, tensors in roles.items():
        for tensor in tensors:
            key = storage_key(tensor)
            if key is not None:
                claimed.setdefault(key, role)
    held = {"params": 0, "grads": 0, "optimizer": 0, "other": 0}
    seen = live_storages()
    for key, size in seen.items():
        held[claimed.get(key, "other")] += size
    for key, role in claimed.items():  # reachable only through C++ (a parameter's .grad): still held
        if key not in seen:
            held[role] += key[1]
    return held
