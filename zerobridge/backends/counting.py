"""Count the collectives a foreign engine (torch FSDP2, DeepSpeed) issues, in the
native engine's bus-volume convention, so ``zerobridge.stats`` means the same
on every backend.

    >>> import torch, torch.distributed as dist
    >>> from zerobridge.backends.counting import counted
    >>> from zerobridge.engine.collectives import CommStats
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> stats = CommStats()
    >>> with counted(stats):
    ...     _ = dist.all_reduce(torch.ones(4))
    >>> dict(stats.calls), dict(stats.bytes)          # a group of one rank moves no bytes
    ({'all_reduce': 1}, {'all_reduce': 0})
    >>> dist.destroy_process_group()

``install`` patches the module attributes of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``) once per process; each active
``CommStats`` (``counted`` or ``attach``) sees every collective issued
while it is active. Engines that imported a function by name before
``install`` are not seen: call it before building them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from zerobridge.engine.collectives import CollectiveKind, CommStats

__all__ = ["attach", "counted", "detach", "install"]

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


def attach(stats: CommStats) -> None:
    """Count every collective from now on into ``stats`` (until ``detach`` or it is collected)."""
    install()
    _ACTIVE.add(stats)


def detach(stats: CommStats) -> None:
    """Stop counting into ``stats``."""
    _ACTIVE.discard(stats)


@contextmanager
def counted(stats: CommStats) -> Iterator[CommStats]:
    """Count the collectives issued inside the block into ``stats``."""
    attach(stats)
    try:
        yield stats
    finally:
        detach(stats)
