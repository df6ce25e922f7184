"""The stepped elements of a flat group, wherever they live, and how they reach
the compute parameters.

    >>> import torch, zerobridge
    >>> from zerobridge.engine import master
    >>> model = zerobridge.prepare(torch.nn.Linear(2, 1), stage=3)
    >>> group = model.zerobridge_engine.groups[0]
    >>> master.write_master(group, 1, torch.tensor([0.5]))      # the bias
    >>> master.read_master(group, 1).tolist()
    [0.5]

The *master* of a group is one of: its compute parameters themselves (``full``
or ``shard``; the sharded parameters view them), a separate ``master`` tensor
(mixed precision, or a cpu tier on an accelerator), a region of a swap file
(the nvme optimizer tier), or, for a frozen group whose shard lives away, that
shard's region. Reads and writes here go to whichever it is, one parameter's
run (or one bucket) at a time, never the whole group at once from a file.
"""

from __future__ import annotations

import torch

from zerobridge.engine.flat_group import FlatGroup

__all__ = ["master_shard", "push_master", "push_run", "read_master", "write_master"]


def read_master(group: FlatGroup, i: int) -> torch.Tensor:
    """Parameter ``i``'s run of master values (1-D): a view when resident, else a
    copy read from the file (or host region) that holds it."""
    piece = group.layout.pieces[i]
    if group.master_file is not None:
        return group.master_file.read(piece.shard_start, torch.empty(piece.numel, dtype=group.plan.master_dtype))
    if group.values_away:
        assert group.away is not None
        return group.away.read(piece.shard_start, torch.empty(piece.numel, dtype=group.plan.compute_dtype))
    return group.master_view(i).reshape(-1)


def write_master(group: FlatGroup, i: int, values: torch.Tensor) -> None:
    """Set parameter ``i``'s run of master values; the compute copies follow at
    ``push_master`` (they are the same elements when the master is no copy)."""
    piece = group.layout.pieces[i]
    if group.master_file is not None:
        group.master_file.write(piece.shard_start, values)
    elif group.values_away:
        assert group.away is not None
        group.away.write(piece.shard_start, values.to(group.plan.compute_dtype))
    else:
        with torch.no_grad():
            group.master_view(i).reshape(-1).copy_(values.reshape(-1))


def master_shard(group: FlatGroup) -> torch.Tensor | None:
    """This rank's master elements in shard layout, in memory (a copy when they live
    in a region); ``None`` for a replicated group whose master is ``full`` itself."""
    numel = group.layout.shard_numel
    if group.master_file is not None:
        return group.master_file.read(0, torch.empty(numel, dtype=group.plan.master_dtype))
    if group.master is not None:
        return group.master
    if group.away is not None:
        return group.away.read(0, torch.empty(numel, dtype=group.plan.compute_dtype))
    return group.shard


def push_master(group: FlatGroup) -> None:
    """Copy every master element into the compute parameters, one bucket at a time."""
    if not group.plan.separate_master:
        return
    r = group.layout.shard_rank
    for b in group.layout.buckets:
        if group.master_file is not None:
            values = group.master_file.read(b.shard_offset, torch.empty(b.piece, dtype=group.plan.master_dtype))
        else:
            assert group.master is not None
            values = group.master[b.in_shard]
        _store_compute(group, b.shard_offset, b.piece_of(r).start, values)


def push_run(group: FlatGroup, i: int, values: torch.Tensor) -> None:
    """Copy parameter ``i``'s stepped run into the compute parameters (nothing to do
    when the sharded parameter views them)."""
    if group.plan.separate_master:
        piece = group.layout.pieces[i]
        _store_compute(group, piece.shard_start, piece.full_start, values.reshape(-1))


def _store_compute(group: FlatGroup, shard_start: int, full_start: int, values: torch.Tensor) -> None:
    count = values.numel()
    with torch.no_grad():
        if group.away is not None:
            group.away.write(shard_start, values.to(group.plan.compute_dtype))
        elif group.shard is not None:
            group.shard[shard_start:shard_start + count].copy_(values)
        else:
            group.full[full_start:full_start + count].copy_(values)
