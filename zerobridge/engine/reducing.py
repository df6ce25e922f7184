"""Gradient reductions: a bucket's reduce-scatter (or stage-0 all-reduce), the hybrid
all-reduce across replica groups, and landing them in the store in one order on
every rank.

    >>> from zerobridge.engine.reducing import MAX_INFLIGHT_REDUCTIONS
    >>> MAX_INFLIGHT_REDUCTIONS
    2

A reduction is a chain of collectives in flight: the reduce-scatter inside the
shard group, then (hybrid sharding) the all-reduce of the reduced piece across
replicas, then the add into the gradient store. Each link is issued when the
previous one lands, and every link is asynchronous, so a hybrid all-reduce
overlaps the next buckets' reduce-scatters and the backward compute instead of
running when its reduce-scatter lands (``ReductionQueue``). On CUDA each link
runs on its own side stream (``streams.py``): casts and reduce-scatters on
``reduce``, the cross-replica all-reduce and its add on ``replicate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zerobridge.engine import collectives
from zerobridge.engine.collectives import Pending
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.streams import Role, Streams
from zerobridge.engine.wire import all_reduce_encoded, reduce_scatter_encoded
from zerobridge.runtime.tensors import same_memory
from zerobridge.spec import WireFormat

__all__ = ["MAX_INFLIGHT_REDUCTIONS", "Reduction", "ReductionQueue", "reduce_bucket"]

MAX_INFLIGHT_REDUCTIONS = 2
"""Reductions in flight at once: a bucket's full gradient is freed once its reduction landed."""


@dataclass
class Reduction:
    """One link of a bucket's reduction in flight; ``then`` lands it (on ``role``'s stream)
    and issues the next link, if any."""

    work: Pending
    then: Callable[[], Reduction | None]
    role: Role


def reduce_bucket(group: FlatGroup, b: int, divisor: float, streams: Streams) -> Reduction:
    """Issue the reduction of bucket ``b`` of ``group``: this micro-step's gradient and
    what was accumulated locally, divided by ``divisor``."""
    bucket, plan, mesh, layout = group.layout.buckets[b], group.plan, group.mesh, group.layout
    computed = streams.mark()  # the gradient exists once the compute stream gets here
    grad, region = group.take_grad(b), bucket.region
    device = group.full.device
    # With side streams a collective is issued in order on its stream (NCCL: the stream
    # waits, the host does not); without them it is left in flight and landed later.
    in_flight = not streams.overlaps
    with streams.on("reduce"):
        streams.follow("reduce", computed)
        streams.lend("reduce", grad)
        acc = group.accumulator() if (group.accumulated[b] or group.store_is_accumulator) else None
        if acc is not None and group.store_is_accumulator:
            # Stage 0/1: the store's own bucket is the buffer reduced in place.
            if grad is not None:
                acc[region].add_(grad)
            x = acc[region] if acc.dtype == plan.reduce_dtype else acc[region].to(plan.reduce_dtype)
        else:
            x = torch.zeros(bucket.numel, dtype=plan.reduce_dtype, device=device) if grad is None else \
                grad.to(plan.reduce_dtype)
            if acc is not None:
                x.add_(acc[region])
        group.accumulated[b] = False
        x.div_(divisor)
        r = layout.shard_rank
        y = x[r * bucket.piece:(r + 1) * bucket.piece]
        if layout.shards == 1:  # stage 0: one all-reduce over the replicas
            work = collectives.all_reduce(y, mesh.replicate, group.stats, async_op=in_flight)
        elif plan.grad_wire is not WireFormat.FULL:  # quantized: all-to-alls summed in fp32 (engine/wire.py)
            work = reduce_scatter_encoded(y, x, plan.grad_wire, plan.grad_block, mesh.reduce, group.stats,
                                          node=mesh.reduce_node, cross=mesh.reduce_cross, node_size=mesh.node_size)
        else:
            work = collectives.reduce_scatter(y, x, mesh.reduce, group.stats, async_op=in_flight)
        scattered = streams.mark("reduce")
    across_replicas = layout.shards > 1 and mesh.replicas > 1
    dst = group.store()[bucket.in_shard if plan.shard_grads else bucket.piece_of(r)]

    def store() -> Reduction | None:
        if not same_memory(y, dst):
            dst.copy_(y) if group.store_is_accumulator else dst.add_(y)
        return None

    def reduced() -> Reduction | None:
        if not across_replicas:
            return store()
        with streams.on("replicate"):  # the reduced piece, summed over the replica groups
            streams.follow("replicate", scattered)
            streams.lend("replicate", y)
            if plan.grad_wire is not WireFormat.FULL:  # quantized across the (inter-node) replicas too
                across = all_reduce_encoded(y, plan.grad_wire, plan.grad_block, mesh.replicate, group.stats)
            else:
                across = collectives.all_reduce(y, mesh.replicate, group.stats, async_op=in_flight)
        return Reduction(across, store, "replicate")
    return Reduction(work, reduced, "reduce")


class ReductionQueue:
    """Buckets reduced in one fixed order on every rank (``order``), as their gradients
    arrive, with at most ``limit`` (``MAX_INFLIGHT_REDUCTIONS``) links in flight."""

    def __init__(self, order: Sequence[tuple[FlatGroup, int]], streams: Streams) -> None:
        self.order = list(order)
        self.streams = streams
        self.limit = MAX_INFLIGHT_REDUCTIONS
        """Links left in flight at once; 0 lands each as it is issued (the DeepSpeed memory model's
        stage 3, whose reductions do not overlap the backward's next gradients)."""
        self.arrival = False
        """Issue buckets in the order they become ready, not ``order``: DeepSpeed's stages 1-2. Only
        where every rank's backward makes its gradients in one order (the DeepSpeed memory model's
        fake world); the engine's fixed order holds on any model."""
        self.ready: set[tuple[int, int]] = set()
        self.cursor = 0
        self.pending: list[Reduction] = []

    def restart(self) -> None:
        """A new backward pass: no bucket is ready."""
        self.ready.clear()
        self.cursor = 0

    def arrived(self, group: FlatGroup, b: int) -> None:
        """Bucket ``b`` of ``group`` is ready (with ``arrival``, it goes first among those not issued)."""
        self.ready.add((id(group), b))
        if self.arrival:
            at = next(k for k in range(self.cursor, len(self.order))
                      if self.order[k][0] is group and self.order[k][1] == b)
            self.order.insert(self.cursor, self.order.pop(at))

    def launch(self, divisor: float, *, flush: bool = False) -> None:
        """Issue the ready buckets at the head of the order (``flush``: every bucket left,
        ready or not: unused parameters reduce zeros)."""
        while self.cursor < len(self.order):
            group, b = self.order[self.cursor]
            if not flush and (id(group), b) not in self.ready:
                return
            self.pending.append(reduce_bucket(group, b, divisor, self.streams))
            self.cursor += 1
            while len(self.pending) > self.limit:
                self._land_first()

    def land_all(self) -> None:
        """Land every reduction in flight, then make the compute stream wait for them."""
        while self.pending:
            self._land_first()
        self.streams.join()

    def _land_first(self) -> None:
        reduction = self.pending.pop(0)
        with self.streams.on(reduction.role):
            reduction.work.wait()
            following = reduction.then()
        if following is not None:
            self.pending.append(following)
