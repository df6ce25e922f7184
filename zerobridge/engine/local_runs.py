"""What a checkpoint sees of an engine: each parameter's local run of elements,
its master values and its optimizer state, wherever they live.

    >>> import torch, zerobridge
    >>> from zerobridge.engine.local_runs import local_runs
    >>> model = zerobridge.prepare(torch.nn.Linear(3, 2), stage=3)
    >>> [(r.names, tuple(r.shape), r.start, r.numel, r.writer) for r in local_runs(model.zerobridge_engine)]
    [(('weight',), (2, 3), 0, 6, True), (('bias',), (2,), 0, 2, True)]

A *run* is the contiguous range ``[start, start + numel)`` of a flattened
parameter that this rank owns (the whole parameter when nothing is sharded).
Ranks of the first replica are its *writers*; other replicas hold the same
values. Reading and writing go through the engine so that state kept in
files (NVMe offload) is read and written there, never all at once in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerobridge.engine import master
from zerobridge.engine.collectives import Pending
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.grad_store import drop_grads

if TYPE_CHECKING:
    from zerobridge.engine.engine import Engine

__all__ = ["LocalRun", "local_runs", "read_master", "read_optimizer_state", "refresh_compute", "write_master",
           "write_optimizer_state"]


@dataclass(frozen=True, eq=False)
class LocalRun:
    """One parameter's run of elements on this rank."""

    names: tuple[str, ...]
    """Fully qualified names (several for tied parameters); the first is canonical."""
    shape: torch.Size
    """The whole parameter's shape."""
    start: int
    """Offset of the run in the flattened parameter."""
    numel: int
    """Elements in the run (0: this rank owns none of it)."""
    trainable: bool
    writer: bool
    """Whether this rank writes the run (its replica is the first)."""
    group: FlatGroup
    index: int
    """Position of the parameter in ``group``."""

    @property
    def param(self) -> nn.Parameter:
        """The sharded parameter: what the optimizer steps and its state is keyed by."""
        return self.group.params[self.index]


def local_runs(engine: Engine) -> list[LocalRun]:
    """Every parameter's run on this rank, in the model's registration order."""
    runs = []
    writer = engine.mesh.rank // engine.mesh.shard_size == 0
    for group in engine.groups:
        for i, ref in enumerate(group.refs):
            piece = group.layout.pieces[i]
            if group.layout.shards == 1:
                start, numel = 0, ref.numel
            else:
                start, numel = piece.param_start, piece.numel
            runs.append(LocalRun(names=ref.names, shape=ref.shape, start=start, numel=numel,
                                 trainable=group.plan.trainable, writer=writer and (numel > 0 or ref.numel == 0),
                                 group=group, index=i))
    order = {id(ref): ref.order for g in engine.groups for ref in g.refs}
    return sorted(runs, key=lambda r: order[id(r.group.refs[r.index])])


def read_master(engine: Engine, run: LocalRun) -> torch.Tensor:
    """The run's master values (1-D, master dtype; a frozen run in a file gives its
    compute dtype); a copy when they live in a file."""
    return master.read_master(run.group, run.index)


def write_master(engine: Engine, run: LocalRun, values: torch.Tensor) -> None:
    """Set the run's master values (cast to the master dtype). Compute copies follow
    at ``refresh_compute``."""
    master.write_master(run.group, run.index, values.to(run.group.plan.master_dtype))


def read_optimizer_state(engine: Engine, optimizer: torch.optim.Optimizer, run: LocalRun) -> dict[str, Any]:
    """The optimizer's state for the run's sharded parameter (empty before the first
    step); read from the swap file when the optimizer tier is nvme."""
    swapper = engine.stepper.swapper
    if swapper is not None and run.trainable:
        return swapper.read_state(optimizer, run.param)
    return dict(optimizer.state.get(run.param, {}))


def write_optimizer_state(engine: Engine, optimizer: torch.optim.Optimizer, run: LocalRun,
                          state: dict[str, Any]) -> None:
    """Replace the optimizer's state for the run's sharded parameter (into the swap
    file when the optimizer tier is nvme); the next step continues from it."""
    engine.stepper.optimizers.add(optimizer)
    swapper = engine.stepper.swapper
    if swapper is not None and run.trainable:
        swapper.write_state(optimizer, run.param, state)
    else:
        optimizer.state[run.param] = dict(state)


def refresh_compute(engine: Engine) -> None:
    """After master values were written: rebuild every compute copy (shards, and
    the replicated groups' full buffers by all-gather). Collective."""
    pending: list[Pending] = []
    for group in engine.groups:
        master.push_master(group)
        drop_grads(group)
        pending.extend(work for _, work in group.after_step())
    for work in pending:
        work.wait()
