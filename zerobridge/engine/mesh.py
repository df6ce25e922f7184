"""The process groups one engine communicates over.

    >>> from zerobridge.engine.mesh import layout_ranks
    >>> layout_ranks(world_size=4, shard_size=2)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])

Ranks are laid out shard-major: shard group ``i`` is the ``N`` consecutive
ranks ``[iN, (i+1)N)`` (one node, when ``N`` is the node size), and replica
group ``j`` holds the ranks with the same position ``j`` inside their shard
group. Gathers and reductions run on separate groups of the same ranks, so
their orders cannot interleave differently on different ranks.

Host tensors (offloaded master values, a full state gathered to the host,
checkpoint control messages) never go to a group whose backend has no CPU
path (NCCL): ``zerobridge.distributed.carries_host`` tells, and
``host_world`` gives a gloo group over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zerobridge.distributed import group_timeout

__all__ = ["Mesh", "build_mesh", "layout_ranks"]


def layout_ranks(*, world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rank lists of the shard groups and of the replica groups."""
    shards = [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]
    replicas = [list(range(pos, world_size, shard_size)) for pos in range(shard_size)]
    return shards, replicas


@dataclass(frozen=True)
class Mesh:
    """This rank's groups. ``None`` stands for a group of one rank."""

    world_size: int
    rank: int
    shard_size: int
    """Ranks that split one copy of the sharded states (N)."""
    shard_rank: int
    """This rank's position in its shard group."""
    gather: dist.ProcessGroup | None
    """All-gathers of parameters over the shard group."""
    reduce: dist.ProcessGroup | None
    """Reduce-scatters of gradients over the shard group."""
    replicate: dist.ProcessGroup | None
    """All-reduce of gradient shards across shard groups (hybrid; stage 0: the world)."""
    secondary_size: int
    """hpZ group size for backward gathers (equal to ``shard_size`` without hpZ)."""
    secondary_rank: int
    secondary: dist.ProcessGroup | None
    """Backward all-gathers of the secondary shard (hpZ)."""
    control: dist.ProcessGroup | None
    """Small all-reduces over every rank: used parameters, overflow flags."""
    node_size: int = 0
    """Ranks of the shard group on one node, when the quantized reduction runs in two hops (0: one hop)."""
    reduce_node: dist.ProcessGroup | None = None
    """The shard group's ranks on this node (first hop of a quantized reduction)."""
    reduce_cross: dist.ProcessGroup | None = None
    """The shard group's ranks at this rank's position on every node (second hop)."""

    @property
    def replicas(self) -> int:
        """Copies of each shard (R = world / N)."""
        return self.world_size // self.shard_size


def _subgroup(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create every group (all ranks must call ``new_group`` for each) and keep ours."""
    mine: dist.ProcessGroup | None = None
    timeout = group_timeout()
    for ranks in rank_lists:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def build_mesh(*, shard_size: int, secondary_size: int, node_size: int = 0) -> Mesh:
    """The groups for shard groups of ``shard_size`` and hpZ groups of ``secondary_size``;
    ``node_size``: the ranks per node, when a quantized reduction should run in two hops (only
    where a shard group spans several whole nodes).

    Collective: every rank of the default group must call it with the same sizes.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    shards, replicas = layout_ranks(world_size=world, shard_size=shard_size)
    secondaries, _ = layout_ranks(world_size=world, shard_size=secondary_size)
    gather = _subgroup(shards, rank)
    reduce = _subgroup(shards, rank)
    replicate = _subgroup(replicas, rank)
    secondary = _subgroup(secondaries, rank) if secondary_size != shard_size else gather
    control = _subgroup([list(range(world))], rank)
    reduce_node = reduce_cross = None
    two_hop = 1 < node_size < shard_size and shard_size % node_size == 0
    if two_hop:
        reduce_node = _subgroup(layout_ranks(world_size=world, shard_size=node_size)[0], rank)
        cross = [[s + k * node_size + pos for k in range(shard_size // node_size)]
                 for s in range(0, world, shard_size) for pos in range(node_size)]
        reduce_cross = _subgroup(cross, rank)
    return Mesh(world_size=world, rank=rank, shard_size=shard_size, shard_rank=rank % shard_size,
                gather=gather, reduce=reduce, replicate=replicate, secondary_size=secondary_size,
                secondary_rank=rank % secondary_size, secondary=secondary, control=control,
                node_size=node_size if two_hop else 0, reduce_node=reduce_node, reduce_cross=reduce_cross)
