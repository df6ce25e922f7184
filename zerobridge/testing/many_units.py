"""A deep stack of small modules, cut into one unit per module or one per block, timed per step.

    >>> from zerobridge.testing.many_units import Blocks, spec_for
    >>> model = Blocks(blocks=2)
    >>> sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    16
    >>> spec_for("module").wrapping.policy, spec_for("block").wrapping.layer_classes
    ('every_module', ('Block',))

What every DeepSpeed ZeRO-3 config becomes (DeepSpeed fetches module by
module) is a unit per module: ``step_times`` trains such a model on every
rank of a group and returns each step's seconds (the slowest rank's), so the
engine's per-unit cost shows as the number of units grows.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import zerobridge
from zerobridge.spec import EveryModuleWrap, ShardingSpec, StrategySpec, TransformerWrap

__all__ = ["Block", "Blocks", "spec_for", "step_times"]

WIDTH, PER_BLOCK = 32, 8


class Block(nn.Module):
    """``PER_BLOCK`` small linear layers with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(PER_BLOCK)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.layers:
            y = torch.tanh(layer(y))
        return x + y


class Blocks(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def spec_for(wrap: str) -> StrategySpec:
    """ZeRO-3 with one unit per module (``module``) or per block (``block``), one unit prefetched."""
    wrapping = EveryModuleWrap() if wrap == "module" else TransformerWrap(layer_classes=("Block",))
    return StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=wrapping,
                        communication={"prefetch_bucket": "per_unit"})  # type: ignore[arg-type]


def step_times(*, blocks: int, wrap: str, backend: str, steps: int = 12) -> list[float]:
    """On every rank: seconds per training step (forward to ``zero_grad``), the slowest rank's."""

    model = Blocks(blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = zerobridge.prepare(model, optimizer, config=spec_for(wrap), backend=backend)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return times
