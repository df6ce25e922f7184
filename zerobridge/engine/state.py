"""Reading state out of an engine: the full state dict and resident bytes.

    >>> from zerobridge.engine.state import unshuffle
    >>> import torch
    >>> from zerobridge.engine.layout import plan_layout
    >>> layout = plan_layout([3, 2], shards=2, shard_rank=0, bucket_cap=3)
    >>> gathered = torch.tensor([0., 1., 3.,   2., 9., 4.])  # rank 0 shard | rank 1 shard (9: padding)
    >>> unshuffle(gathered, layout).tolist()
    [0.0, 1.0, 2.0, 9.0, 3.0, 4.0]

``unshuffle`` turns rank-major shards (each the concatenation of its pieces
of every bucket) back into the full flat layout.
"""

from __future__ import annotations

import torch
from torch import nn

from zerobridge.engine import collectives
from zerobridge.engine.collectives import CommStats
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.layout import GroupLayout
from zerobridge.engine.mesh import Mesh

__all__ = ["full_state_dict", "resident_bytes", "unshuffle"]


def unshuffle(gathered: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """Full flat buffer from all ranks' shards laid end to end."""
    out = torch.empty_like(gathered)
    for b in layout.buckets:
        for r in range(layout.shards):
            src = r * layout.shard_numel + b.shard_offset
            out[b.piece_of(r)] = gathered[src:src + b.piece]
    return out


def full_master(group: FlatGroup, mesh: Mesh, stats: CommStats) -> torch.Tensor:
    """The group's master values in the full flat layout, on every rank."""
    shard = group.master if group.master is not None else group.shard
    if shard is None:  # replicated with the master in the compute buffer itself
        return group.full
    if group.layout.shards == 1:
        return shard
    gathered = torch.empty(group.layout.numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather(gathered, shard, mesh.gather, stats)
    return unshuffle(gathered, group.layout)


def full_state_dict(model: nn.Module, groups: list[FlatGroup], mesh: Mesh,
                    stats: CommStats) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter whole, under each of its names."""
    state = model.state_dict()
    for group in groups:
        full = full_master(group, mesh, stats)
        for ref, offset in zip(group.refs, group.layout.offsets):
            value = full[offset:offset + ref.numel].view(ref.shape).clone()
            for name in ref.names:
                state[name] = value
    return state


def resident_bytes(groups: list[FlatGroup], optimizers: object) -> dict[str, int]:
    """Bytes the groups and the optimizers' states (for these groups) hold now."""
    params = grads = master = 0
    for group in groups:
        sizes = group.resident_bytes()
        params, grads, master = params + sizes["params"], grads + sizes["grads"], master + sizes["master"]
    owned = {id(p) for g in groups for p in g.params}
    seen: set[int] = set()
    states = 0
    for optimizer in list(optimizers):  # type: ignore[call-overload]
        for param, state in optimizer.state.items():
            if id(param) not in owned:
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        states += storage.nbytes()
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": master + states}
