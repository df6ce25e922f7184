"""What collectives move: bytes and calls per kind, counted the same way on every backend.

    >>> import torch, torch.distributed as dist
    >>> from zerobridge.runtime.comm_stats import CommStats, bus_bytes, counted
    >>> bus_bytes("all_reduce", torch.empty(1000), group_size=4)
    6000
    >>> stats = CommStats(); stats.record("all_gather", 3000, group_size=4); dict(stats.bytes)
    {'all_gather': 2250}
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> stats = CommStats()
    >>> with counted(stats):
    ...     _ = dist.all_reduce(torch.ones(4))
    >>> dict(stats.calls), dict(stats.bytes)          # a group of one rank moves no bytes
    ({'all_reduce': 1}, {'all_reduce': 0})
    >>> dist.destroy_process_group()

Bytes follow the bus-volume convention (per rank): an all-reduce of ``n``
bytes over ``G`` ranks moves ``2n(G-1)/G``; a reduce-scatter of an ``n``-byte
input, an all-gather of an ``n``-byte output, or an all-to-all sending ``n``
bytes (a quantized reduction, ``engine/wire.py``) moves ``n(G-1)/G``.

The native engine records each collective it issues itself
(``engine/collectives.py``). A foreign engine (torch FSDP2, DeepSpeed) is
counted from outside: ``install`` patches the module attributes of
``torch.distributed`` (and of ``torch.distributed.distributed_c10d``) once per
process, and each active ``CommStats`` (``counted`` or ``count_into``) sees
every collective issued while it is active. Engines that imported a function
by name before ``install`` are not seen: call it before building them.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveKind", "CommStats", "bus_bytes", "count_into", "counted", "install", "stop_counting"]

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all"]
_BUS_FACTOR: dict[str, float] = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "broadcast": 1.0,
                                 "all_to_all": 1.0}


@dataclass(eq=False)
class CommStats:
    """Bytes and calls per collective kind since the last ``reset``."""

    bytes: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)

    def record(self, kind: CollectiveKind, payload_bytes: int, *, group_size: int) -> None:
        """Count one collective whose payload (full buffer) is ``payload_bytes``."""
        factor = _BUS_FACTOR[kind] * (group_size - 1) / group_size
        self.bytes[kind] += round(payload_bytes * factor)
        self.calls[kind] += 1

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.bytes.clear()
        self.calls.clear()


def bus_bytes(kind: CollectiveKind, payload: torch.Tensor, *, group_size: int) -> int:
    """Per-rank bus bytes of one collective over ``payload`` (the full buffer)."""
    nbytes = payload.numel() * payload.element_size()
    return round(nbytes * _BUS_FACTOR[kind] * (group_size - 1) / group_size)


# function name -> (kind, position and keyword of the full buffer, position of the group)
_FUNCTIONS: dict[str, tuple[CollectiveKind, int, str, int]] = {
    "all_reduce": ("all_reduce", 0, "tensor", 2),
    "broadcast": ("broadcast", 0, "tensor", 2),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2),
    "all_gather_single": ("all_gather", 0, "output_tensor", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3),
    "all_gather": ("all_gather", 0, "tensor_list", 2),
    "reduce_scatter": ("reduce_scatter", 1, "input_list", 3),
    "all_to_all_single": ("all_to_all", 1, "input", 4),
}
_ACTIVE: weakref.WeakSet[CommStats] = weakref.WeakSet()
_INSTALLED = False


def _payload_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_payload_bytes(v) for v in value)
    return 0


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    kind, index, keyword, group_at = _FUNCTIONS[name]

    @functools.wraps(original)
    def counted_call(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE:
            buffer = args[index] if len(args) > index else kwargs.get(keyword)
            group = args[group_at] if len(args) > group_at else kwargs.get("group")
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            payload = _payload_bytes(buffer)
            for stats in list(_ACTIVE):
                stats.record(kind, payload, group_size=size)
        return original(*args, **kwargs)

    counted_call.__zerobridge_counted__ = True  # type: ignore[attr-defined]
    return counted_call


def install() -> None:
    """Patch the collectives of ``torch.distributed`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name in _FUNCTIONS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__zerobridge_counted__", False):
            continue
        wrapped = _wrap(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    _INSTALLED = True


def count_into(stats: CommStats) -> None:
    """Count every collective from now on into ``stats`` (until ``stop_counting`` or it is collected)."""
    install()
    _ACTIVE.add(stats)


def stop_counting(stats: CommStats) -> None:
    """Stop counting into ``stats``."""
    _ACTIVE.discard(stats)


@contextmanager
def counted(stats: CommStats) -> Iterator[CommStats]:
    """Count the collectives issued inside the block into ``stats``."""
    count_into(stats)
    try:
        yield stats
    finally:
        stop_counting(stats)
