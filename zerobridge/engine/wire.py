"""Collectives whose payload travels quantized: ZeRO++ qwZ and qgZ, float8 all-gather.

    >>> import torch
    >>> from zerobridge.engine.wire import all_gather_encoded, reduce_scatter_encoded
    >>> from zerobridge.runtime.comm_stats import CommStats
    >>> from zerobridge.spec import WireFormat
    >>> out = torch.empty(4)
    >>> all_gather_encoded(out, torch.tensor([1.0, 2.0, 3.0, 4.0]), WireFormat.INT8, 2048, None, CommStats()).wait()
    True
    >>> out                                  # a group of one rank: nothing travels, nothing is rounded
    tensor([1., 2., 3., 4.])

**Gathers** (``all_gather_encoded``): each rank encodes its shard
(``runtime/wire_codecs.py``: int8 block-wise or fp8 with its scale), the group
all-gathers the equal byte pieces, and every rank decodes every piece, its
own included, into the gathered buffer: all ranks compute with the same
values. The decode runs when the gather is waited for, on the stream that
waits.

**Reductions** (``reduce_scatter_encoded``): a quantized value cannot be
summed on the wire, so each rank encodes the piece every other rank owns and
sends it (an all-to-all); the owner decodes what it receives and sums in
fp32. When the shard group spans nodes (``Mesh.node_size`` ranks to a node),
it runs in two hops as ZeRO++'s qgZ does: inside the node, each rank sends
its neighbours the pieces owned by ranks at their position on every node, and
sums what arrives; then between nodes, each rank sends each node the partial
sum for the rank at its own position there. Inside a node every piece
crosses once; between nodes only ``1 / node_size`` of the bucket per rank
does, quantized. Every hop is counted in ``CommStats`` as ``all_to_all``, in
the bytes that move.

**All-reduces** (``all_reduce_encoded``: a hybrid layout's gradient shard summed
across replicas, which crosses nodes): the same all-to-all, each rank summing
one ``1 / replicas`` piece in fp32, then an encoded all-gather of the sums, so
every replica decodes the same values and steps alike.

A group of one rank moves nothing and rounds nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerobridge.engine import collectives
from zerobridge.engine.collectives import DONE, Pending, group_size
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.wire_codecs import WireLayout, decode, encode_into, wire_layout
from zerobridge.spec import WireFormat

__all__ = ["EncodedGather", "all_gather_encoded", "all_reduce_encoded", "reduce_scatter_encoded"]


class EncodedGather:
    """An encoded all-gather in flight: ``wait`` decodes every rank's piece into the output."""

    def __init__(self, work: Pending, wire: torch.Tensor, layout: WireLayout, output: torch.Tensor,
                 ranks: int) -> None:
        self.work, self.wire, self.layout, self.output, self.ranks = work, wire, layout, output, ranks

    def wait(self) -> bool:
        """Block until the bytes are there, then decode them into the output."""
        self.work.wait()
        pieces = self.wire.view(self.ranks, self.layout.wire_bytes)
        n = self.layout.numel
        for r in range(self.ranks):
            decode(pieces[r], self.layout, self.output[r * n:(r + 1) * n])
        return True


def all_gather_encoded(output: torch.Tensor, shard: torch.Tensor, fmt: WireFormat, block_size: int,
                       group: dist.ProcessGroup | None, stats: CommStats, *, async_op: bool = False) -> Pending:
    """Gather every rank's ``shard`` into ``output`` (rank-major), travelling as ``fmt``."""
    ranks = group_size(group)
    if ranks == 1:
        return collectives.all_gather(output, shard, group, stats, async_op=async_op)
    layout = wire_layout(fmt.value, shard.numel(), block_size)
    wire = torch.empty(ranks * layout.wire_bytes, dtype=torch.uint8, device=shard.device)
    rank = dist.get_rank(group)
    mine = wire[rank * layout.wire_bytes:(rank + 1) * layout.wire_bytes]
    encode_into(shard.reshape(-1), layout, mine)
    work = collectives.all_gather(wire, mine, group, stats, async_op=async_op)
    gather = EncodedGather(work, wire, layout, output, ranks)
    if async_op:
        return gather
    gather.wait()
    return DONE


def _exchange(pieces: torch.Tensor, fmt: WireFormat, block_size: int, group: dist.ProcessGroup | None,
              stats: CommStats) -> torch.Tensor:
    """All-to-all of ``pieces`` (``[G, ...]``: piece ``j`` goes to rank ``j``), each encoded; returns
    the sum over senders of what this rank received, in fp32 (``pieces.shape[1:]``)."""
    ranks = pieces.shape[0]
    flat = pieces.reshape(ranks, -1)
    layout = wire_layout(fmt.value, flat.shape[1], block_size)
    send = torch.empty(ranks * layout.wire_bytes, dtype=torch.uint8, device=pieces.device)
    for j in range(ranks):
        encode_into(flat[j], layout, send[j * layout.wire_bytes:(j + 1) * layout.wire_bytes])
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group, stats)
    total = torch.zeros(flat.shape[1], dtype=torch.float32, device=pieces.device)
    part = torch.empty_like(total)
    for i in range(ranks):
        total.add_(decode(received[i * layout.wire_bytes:(i + 1) * layout.wire_bytes], layout, part))
    return total.view(pieces.shape[1:])


def reduce_scatter_encoded(output: torch.Tensor, full: torch.Tensor, fmt: WireFormat, block_size: int,
                           group: dist.ProcessGroup | None, stats: CommStats, *,
                           node: dist.ProcessGroup | None = None, cross: dist.ProcessGroup | None = None,
                           node_size: int = 0) -> Pending:
    """Sum ``full`` (``[G * piece]``) over the group; this rank's ``piece`` lands in ``output``,
    summed in fp32 from pieces that travelled as ``fmt``. With ``node`` and ``cross`` (the group's
    ranks on this node, and those at this rank's position on every node: ``node_size`` to a
    node), in two hops. Runs to completion (the decode needs the bytes)."""
    ranks = group_size(group)
    if ranks == 1:
        return collectives.reduce_scatter(output, full, group, stats)
    piece = full.numel() // ranks
    if node is not None and cross is not None and 1 < node_size < ranks:
        nodes = ranks // node_size
        # hop 1: to the neighbour at position l, the pieces of position l on every node: [L, M, piece]
        by_position = full.view(nodes, node_size, piece).transpose(0, 1)
        partial = _exchange(by_position, fmt, block_size, node, stats)     # [M, piece]: this position, every node
        summed = _exchange(partial, fmt, block_size, cross, stats)         # [piece]: this rank's own
    else:
        summed = _exchange(full.view(ranks, piece), fmt, block_size, group, stats)
    output.copy_(summed.view(-1))
    return DONE


def all_reduce_encoded(tensor: torch.Tensor, fmt: WireFormat, block_size: int, group: dist.ProcessGroup | None,
                       stats: CommStats) -> Pending:
    """Sum ``tensor`` (flat) over the group in place, travelling as ``fmt`` twice: an all-to-all of
    ``1 / G`` pieces summed in fp32 by their owner, then an encoded all-gather of the sums that every
    rank (the owner included) decodes, so all ranks end with the same values. Runs to completion."""
    ranks = group_size(group)
    if ranks == 1:
        return DONE
    count = tensor.numel()
    piece = -(-count // ranks)
    padded = torch.zeros(ranks * piece, dtype=tensor.dtype, device=tensor.device)
    padded[:count].copy_(tensor.reshape(-1))
    summed = _exchange(padded.view(ranks, piece), fmt, block_size, group, stats)
    gathered = torch.empty(ranks * piece, dtype=torch.float32, device=tensor.device)
    all_gather_encoded(gathered, summed, fmt, block_size, group, stats)
    tensor.view(-1).copy_(gathered[:count])
    return DONE
