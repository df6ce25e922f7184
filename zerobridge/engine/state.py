"""Reading state out of an engine: the full state dict, resident bytes and
bytes per tier.

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

from typing import Any

import torch
from torch import nn

from zerobridge.engine import collectives
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.layout import GroupLayout
from zerobridge.engine.master import master_shard
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.nvme_step import StateSwapper
from zerobridge.engine.quantized_store import QuantizedRegion
from zerobridge.engine.swapfile import FileRegion
from zerobridge.engine.tiers import ON_DEVICE, Placement
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.tensors import storage_bytes, storage_id

__all__ = ["full_state_dict", "group_bytes", "memory", "unshuffle"]

TIERS = ("device", "host", "nvme")


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
    shard = master_shard(group)
    if shard is None:  # replicated with the master in the compute buffer itself
        return group.full
    if group.layout.shards == 1:
        return shard
    # Master values on the host (offload tiers) are staged on the compute device: the
    # gather group may have no CPU path (NCCL).
    shard = shard.to(group.full.device, non_blocking=True)
    gathered = torch.empty(group.layout.numel, dtype=shard.dtype, device=shard.device)
    collectives.all_gather(gathered, shard, mesh.gather, stats)
    return unshuffle(gathered, group.layout)


def full_state_dict(model: nn.Module, groups: list[FlatGroup], mesh: Mesh, stats: CommStats, *,
                    rank0_only: bool = False, offload_to_cpu: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter whole, under each of its names.

    One group is gathered at a time and let go before the next. ``rank0_only``:
    only rank 0 keeps the values (the others return ``{}``, and ranks outside
    rank 0's shard group do not communicate). ``offload_to_cpu``: each group's
    values go to host memory as soon as they are gathered, so no rank holds
    the whole model on its device."""
    keep = not rank0_only or mesh.rank == 0
    if rank0_only and mesh.rank >= mesh.shard_size:
        return {}
    state = model.state_dict() if keep else {}
    if offload_to_cpu:
        state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    for group in groups:
        full = full_master(group, mesh, stats)
        if not keep:
            continue
        for ref, offset in zip(group.refs, group.layout.offsets):
            run = full[offset:offset + ref.numel].view(ref.shape)
            value = run.to("cpu", copy=True) if offload_to_cpu else run.clone()
            for name in ref.names:
                state[name] = value
        del full
    return state


def group_bytes(group: FlatGroup) -> dict[tuple[str, str], int]:
    """Bytes a group holds at rest, by (role, tier): roles ``params``, ``grads`` and
    ``master`` (a frozen group's master counts as parameters); tiers ``device``,
    ``host`` (memory of an offloaded tier) and ``nvme`` (swap files)."""
    out: dict[tuple[str, str], int] = {}

    def add(role: str, tier: str, nbytes: int) -> None:
        out[(role, tier)] = out.get((role, tier), 0) + nbytes

    master_role = "master" if group.plan.trainable else "params"
    compute: Placement = group.plan.shard_at if group.shard is not None else ON_DEVICE
    add("params", compute.resident_label,
        storage_bytes(group.shard) if group.shard is not None else storage_bytes(group.full))
    add("params", "device", storage_bytes(group.secondary))
    add(master_role, group.plan.master_at.resident_label, storage_bytes(group.master))
    if group.plan.trainable:
        add("grads", "device", storage_bytes(group.grad_store) + storage_bytes(group.local_acc))
        add("grads", group.plan.master_at.resident_label, storage_bytes(group.optimizer_grads))
    for role, region, at in (("params", group.away, compute), (master_role, group.master_file, group.plan.master_at)):
        if isinstance(region, QuantizedRegion):  # a frozen shard's int8 codes: where their bytes are
            region = region.store
        if region is not None:
            add(role, "nvme" if isinstance(region, FileRegion) else at.resident_label, region.nbytes)
    return out


def memory(groups: list[FlatGroup], optimizers: object, swapper: StateSwapper | None,
           optimizer_tier: Placement) -> dict[str, Any]:
    """Resident bytes by role (``param_bytes``, ``grad_bytes``, ``optimizer_bytes``:
    master plus optimizer state) and ``tier_bytes``: everything by where it lives."""
    resident = {"params": 0, "grads": 0, "master": 0}
    tiers = dict.fromkeys(TIERS, 0)
    for group in groups:
        for (role, tier), nbytes in group_bytes(group).items():
            tiers[tier] += nbytes
            if tier != "nvme":
                resident[role] += nbytes
    owned = {id(p) for g in groups for p in g.params}
    seen: set[int] = set()
    states = 0
    for optimizer in list(optimizers):  # type: ignore[call-overload]
        for param, state in optimizer.state.items():
            if id(param) not in owned:
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor) and storage_id(value) not in seen:
                    seen.add(storage_id(value))
                    states += value.untyped_storage().nbytes()
    tiers[optimizer_tier.resident_label] += states
    if swapper is not None:
        kept = swapper.resident_bytes()
        states += kept
        tiers["host"] += kept
        tiers["nvme"] += swapper.file_bytes()
    return {"param_bytes": resident["params"], "grad_bytes": resident["grads"],
            "optimizer_bytes": resident["master"] + states, "tier_bytes": tiers}
