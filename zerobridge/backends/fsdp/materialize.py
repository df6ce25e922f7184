"""Give a model that FSDP2 sharded on the meta device its initial values, one module at a time.

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from zerobridge.backends.fsdp.materialize import shard_piece
    >>> value = torch.arange(10.0).reshape(5, 2)
    >>> [shard_piece(value, [Shard(0)], (4,), (rank,)).shape[0] for rank in range(4)]   # torch.chunk's split
    [2, 2, 1, 0]

FSDP2's own meta path: ``fully_shard`` runs on the meta model (each
parameter becomes a DTensor whose local shard is still on meta),
``to_empty`` allocates every rank's padded shard on the device (the CPU
when parameters are offloaded), and then each module's tensors come from
the construction replay (``zerobridge/runtime/deferred_init.py``): the full value of
one module's parameters on the CPU, of which this rank copies its shard
into the DTensor's local tensor; buffers are written whole. FSDP2 splits
dim 0 as ``torch.chunk`` does (the last shards shorter or empty, padded to
the first's size), over each mesh dimension whose placement is ``Shard``;
the padding stays zero, as ``to_empty``'s re-pad leaves it. The local
shape is checked against FSDP2's so that a changed rule fails loudly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

from zerobridge.errors import ConfigError
from zerobridge.runtime.deferred_init import Replay

__all__ = ["materialize_fsdp", "shard_piece"]


def shard_piece(value: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int],
                coordinate: Sequence[int]) -> torch.Tensor:
    """This rank's piece of the full ``value`` under ``placements``: for each mesh dimension
    that shards, ``torch.chunk`` along the sharded dim, chunk ``coordinate`` (empty past the last)."""
    for size, index, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(value, size, dim=placement.dim)
            value = chunks[index] if index < len(chunks) else value.narrow(placement.dim, 0, 0)
    return value


def _write_param(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if not isinstance(param, DTensor):
        param.copy_(value.to(param.dtype))
        return
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is in the mesh"
    piece = shard_piece(value, param.placements, mesh.shape, coordinate)
    local = param.to_local()
    if piece.shape != local.shape:
        raise ConfigError(f"{name}: FSDP2 holds a local shard of shape {tuple(local.shape)} where dim-0 chunking "
                          f"gives {tuple(piece.shape)}", key="backend",
                          fix="this torch version shards differently: use backend='native' for meta-device models")
    local.copy_(piece.to(local.dtype))


def materialize_fsdp(model: nn.Module, replay: Replay, device: torch.device, *, offloaded: bool) -> None:
    """Allocate the sharded ``model`` (``to_empty``: on ``device``, on the CPU when ``offloaded``)
    and write every rank's shard and every buffer (on ``device``) from ``replay`` (already
    recorded), one module at a time. Local: no collective (every rank replays the same values)."""
    model.to_empty(device=torch.device("cpu") if offloaded else device)
    with torch.no_grad():
        for key, value in replay.by_module():
            owner, attr, is_buffer = replay.first[key]
            if is_buffer:
                replay.put_buffer(key, value, device)
            else:
                current = owner._parameters[attr]
                assert current is not None
                _write_param(current, value, replay.names[key])
            del value
