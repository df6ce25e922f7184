"""Train the built-in tiny GPT under a strategy, or in one process as the reference.

    >>> from zerobridge.testing.gpt import reference_gpt
    >>> ref = reference_gpt(steps=2, seq_len=8)
    >>> len(ref.losses)
    2

Both draw the same global batch per step from ``SyntheticTokens``; a rank
trains on its ``shard`` of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zerobridge
from zerobridge.distributed import run_device
from zerobridge.models.data import SyntheticTokens, shard
from zerobridge.models.tiny_gpt import no_weight_decay, tiny_gpt
from zerobridge.testing.parity import RunResult

__all__ = ["reference_gpt", "train_gpt"]


def _optimizer(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW as ``examples/train_gpt.py`` builds it."""
    decay = [p for n, p in named if not no_weight_decay(n)]
    plain = [p for n, p in named if no_weight_decay(n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                             lr=3e-3)


def reference_gpt(*, steps: int = 5, preset: str = "tiny", global_batch: int = 8, seq_len: int = 16,
                  seed: int = 0) -> RunResult:
    """One process on the whole global batch."""
    model = tiny_gpt(preset, seed=seed)
    data = SyntheticTokens(model.config.vocab_size, seq_len, seed=seed)
    optimizer = _optimizer(list(model.named_parameters()))
    result = RunResult()
    for step in range(steps):
        x, y = data.batch(step, global_batch)
        loss = model(x, targets=y)
        loss.backward()
        result.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        result.losses.append(loss.item())
    result.state = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def train_gpt(*, stage: int | None = None, spec: Any = None, steps: int = 5, preset: str = "tiny",
              global_batch: int = 8, seq_len: int = 16, seed: int = 0) -> RunResult:
    """On every rank: the same training, sharded by ``stage`` or ``spec``."""

    rank, world = dist.get_rank(), dist.get_world_size()
    device = run_device()
    model = tiny_gpt(preset, seed=seed).to(device)
    data = SyntheticTokens(model.config.vocab_size, seq_len, seed=seed)
    model = zerobridge.prepare(model, stage=stage) if spec is None else zerobridge.prepare(model, config=spec)
    optimizer = _optimizer(list(model.named_parameters()))
    result = RunResult()
    for step in range(steps):
        x, y = (shard(t, rank, world).to(device) for t in data.batch(step, global_batch))
        loss = model(x, targets=y)
        loss.backward()
        result.grad_norms.append(zerobridge.clip_grad_norm_(model, 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        result.losses.append(total.item() / world)
    result.state = {k: v.cpu() for k, v in zerobridge.full_state_dict(model).items()}
    return result
