"""The collectives the engine issues: free functions over explicit groups.

    >>> import torch
    >>> from zerobridge.engine.collectives import all_reduce
    >>> from zerobridge.runtime.comm_stats import CommStats
    >>> stats = CommStats()
    >>> all_reduce(torch.ones(3), None, stats).wait()     # no group: one rank, nothing moves
    True
    >>> dict(stats.bytes)
    {}

Every function takes the process group it runs on and the ``CommStats`` it is
counted in; nothing here reads global state. A group of one rank is a no-op
that moves no bytes. Tests count calls by patching these functions, so the
engine calls them through this module (``collectives.all_gather(...)``),
never by importing the names.

The flat gather and reduce-scatter are ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` where torch has them (2.13 on); older torch
has the same collectives as ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, used instead (``flat_collective``).

Bytes are counted in ``CommStats`` (``runtime/comm_stats.py``), in the
bus-volume convention every backend shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zerobridge.distributed import carries_host
from zerobridge.runtime.comm_stats import CollectiveKind, CommStats
from zerobridge.runtime.tensors import same_memory

__all__ = ["Pending", "all_gather", "all_reduce", "all_to_all", "broadcast", "broadcast_module", "flat_collective",
           "group_size", "reduce_scatter"]

# kind -> (torch >= 2.13 name, the older name of the same collective)
_FLAT_NAMES: dict[str, tuple[str, str]] = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                                           "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
                                           "all_to_all": ("all_to_all_single", "all_to_all_single")}


class Pending(Protocol):
    """An issued collective: ``wait()`` blocks until its buffers are ready."""

    def wait(self) -> object: ...


class _Done:
    """A collective that needed no communication (a group of one rank)."""

    def wait(self) -> bool:
        return True


DONE: Pending = _Done()


def flat_collective(kind: str) -> Callable[..., Any]:
    """torch's flat single-tensor ``kind`` (``all_gather``, ``reduce_scatter`` or ``all_to_all``):
    the 2.13 name when this torch has it, else the older one (``all_to_all_single`` has one name).

    Looked up at every call, so a test can hide the new names.
    """
    new, old = _FLAT_NAMES[kind]
    issue = getattr(dist, new, None)
    return issue if issue is not None else getattr(dist, old)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` stands for a group of one (nothing to communicate)."""
    return 1 if group is None else dist.get_world_size(group)


def _check_host(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A host tensor never goes to a group without a CPU path (NCCL): callers stage it on the
    device or use a gloo group (``zerobridge.distributed.host_world``)."""
    if tensor.device.type == "cpu" and not carries_host(group):
        raise RuntimeError(f"a CPU tensor was handed to a {dist.get_backend_config(group)} group, which has no "
                           "CPU path: stage it on the device first, or use a gloo group "
                           "(zerobridge.distributed.host_world)")


def _flat(kind: CollectiveKind, output: torch.Tensor, source: torch.Tensor, full: torch.Tensor,
          group: dist.ProcessGroup | None, stats: CommStats, async_op: bool) -> Pending:
    """One flat single-tensor collective; ``full`` is the buffer the volume counts."""
    size = group_size(group)
    if size == 1:
        if not same_memory(source, output):
            output.copy_(source)
        return DONE
    _check_host(full, group)
    stats.record(kind, full.numel() * full.element_size(), group_size=size)
    work = flat_collective(kind)(output, source, group=group, async_op=async_op)
    return work if async_op else DONE


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None,
               stats: CommStats, *, async_op: bool = False) -> Pending:
    """Gather equal ``shard``s of every rank into ``output`` (rank-major).

    ``shard`` may be this rank's slice of ``output`` (an in-place gather).
    """
    return _flat("all_gather", output, shard, output, group, stats, async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None,
                   stats: CommStats, *, async_op: bool = False) -> Pending:
    """Sum ``full`` over the group; this rank receives its rank-major slice.

    ``output`` may alias this rank's slice of ``full`` (an in-place reduce).
    """
    return _flat("reduce_scatter", output, full, full, group, stats, async_op)


def all_to_all(output: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats, *,
               async_op: bool = False) -> Pending:
    """Rank ``i`` sends ``source``'s ``j``-th equal piece to rank ``j``, which writes it as the
    ``i``-th piece of its ``output`` (rank-major pieces)."""
    return _flat("all_to_all", output, source, source, group, stats, async_op)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats, *,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> Pending:
    """Reduce ``tensor`` in place over the group (sum unless ``op`` says)."""
    size = group_size(group)
    if size == 1:
        return DONE
    _check_host(tensor, group)
    stats.record("all_reduce", tensor.numel() * tensor.element_size(), group_size=size)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else DONE


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, stats: CommStats) -> None:
    """Overwrite ``tensor`` on every rank with global rank ``src``'s copy."""
    size = group_size(group)
    if size == 1:
        return
    _check_host(tensor, group)
    stats.record("broadcast", tensor.numel() * tensor.element_size(), group_size=size)
    dist.broadcast(tensor, src=src, group=group)


def broadcast_module(module: torch.nn.Module, src: int, group: dist.ProcessGroup | None, stats: CommStats) -> None:
    """Every parameter and buffer of ``module`` takes global rank ``src``'s values; meta
    tensors (deferred initialization: every rank replays the same values) are left."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                broadcast(tensor.data, src, group, stats)
