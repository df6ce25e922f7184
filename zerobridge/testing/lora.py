"""A LoRA-style model (frozen base layers, small trainable adapters) and what a rank holds in backward.

    >>> from zerobridge.testing.lora import LoraNet, run_lora_reference
    >>> net = LoraNet(blocks=2, width=16, rank=2)
    >>> sum(p.numel() for p in net.parameters() if not p.requires_grad), len(run_lora_reference(steps=2, blocks=2))
    (561, 2)

``run_lora`` trains ``LoraNet`` on every rank of a process group (native engine
or ``backend="fsdp"``) and samples, whenever a gradient reaches any module's
output in backward, the bytes of every tensor storage alive in the process
(found through the garbage collector, so every engine is measured the same
way); it returns the losses and the peak of those samples above the bytes
alive just before backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerobridge
from zerobridge.compare.memory import live_storages

__all__ = ["LoraBlock", "LoraNet", "live_tensor_bytes", "lora_batch", "run_lora", "run_lora_reference"]


class LoraBlock(nn.Module):
    """A frozen ``width x width`` projection plus a rank-``rank`` trainable update, residual."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.base(x) + self.lora_b(self.lora_a(x)))


class LoraNet(nn.Module):
    """``blocks`` LoRA blocks between a frozen input projection and a frozen head."""

    _no_split_modules = ["LoraBlock"]

    def __init__(self, blocks: int = 8, width: int = 64, rank: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([LoraBlock(width, rank) for _ in range(blocks)])
        self.head = nn.Linear(width, 1)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def lora_batch(step: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs (``rows x width``) and regression targets, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, width, generator=g), torch.randn(rows, generator=g)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach."""
    return sum(live_storages().values())


def run_lora_reference(*, steps: int = 4, blocks: int = 8, width: int = 256, rows: int = 8) -> list[float]:
    """One process, the whole batch: the losses a sharded run must match."""
    model = LoraNet(blocks, width)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.003)
    losses = []
    for step in range(steps):
        loss = model(*lora_batch(step, rows, width))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_lora(*, stage: int = 3, backend: str = "native", steps: int = 4, blocks: int = 8, width: int = 256,
             rows: int = 8, measure: bool = True) -> dict[str, Any]:
    """On every rank: ``LoraNet`` trained under ``stage`` on ``backend``; losses (global means),
    and with ``measure`` the peak live tensor bytes above the start of backward, per step."""

    rank, world = dist.get_rank(), dist.get_world_size()
    model = LoraNet(blocks, width)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.003)
    model, optimizer = zerobridge.prepare(model, optimizer, stage=stage, backend=backend)
    samples: list[int] = []

    def sample(grad: torch.Tensor) -> None:
        samples.append(live_tensor_bytes())

    def watch(module: nn.Module, args: Any, output: Any) -> None:
        if measure and torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(sample)

    for module in model.modules():
        module.register_forward_hook(watch)
    losses, peaks = [], []
    per = rows // world
    for step in range(steps):
        x, y = lora_batch(step, rows, width)
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        samples.clear()
        before = live_tensor_bytes() if measure else 0
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        peaks.append(max(samples, default=before) - before)
    unit = sum(p.numel() * p.element_size() for p in LoraBlock(width, 4).parameters())
    return {"losses": losses, "peak_backward_bytes": max(peaks) if measure else 0, "block_bytes": unit,
            "base_bytes": blocks * (width * width + width) * 4}
