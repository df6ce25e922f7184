"""Train, save, load and go on: the loops the checkpoint tests run on every rank.

    >>> import torch
    >>> from zerobridge.testing.parity import ParityNet, make_optimizer
    >>> from zerobridge.testing.resume import train_steps
    >>> model = ParityNet(0)
    >>> losses = train_steps(model, make_optimizer(list(model.named_parameters()), "adamw"), range(2),
    ...                      clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    >>> len(losses), losses[0] > losses[1]
    (2, True)

``train_steps`` is ``zerobridge.testing.parity.run_reference``'s loop with
the global batch split across the ranks of the default group (one process
without a group), so every run here is comparable with ``run_reference``
and with ``zerobridge.testing.deepspeed_run.train_deepspeed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerobridge
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing.parity import ParityNet, batch, make_optimizer

__all__ = ["GLOBAL_BATCH", "clip_native", "native", "resume_native", "train_steps"]

GLOBAL_BATCH = 8


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range,
                clip: Callable[[nn.Module], Any], global_batch: int = GLOBAL_BATCH) -> list[float]:
    """Train on steps ``steps`` of the parity batches; the mean loss of each step."""
    grouped = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    per_rank = global_batch // world
    losses = []
    for step in steps:
        tokens, targets = batch(step, 0, global_batch)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = model(tokens[mine], targets[mine])
        loss.backward()
        clip(model)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().reshape(1)
        if grouped:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def native(seed: int, stage: int | None = None, spec: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """ParityNet under the native engine (``stage`` or ``spec``) with the parity AdamW."""

    model = ParityNet(seed)
    model = zerobridge.prepare(model, config=spec if spec is not None else spec_for_stage(stage or 0, model))
    return model, make_optimizer(list(model.named_parameters()), "adamw")


def clip_native(model: nn.Module) -> None:
    """The parity runs' clipping (global norm 1.0) on a prepared model."""

    zerobridge.clip_grad_norm_(model, 1.0)


def resume_native(path: str, *, start: int, stop: int, stage: int | None = None, spec: Any = None) -> dict[str, Any]:
    """A fresh ParityNet (another seed) and optimizer (other hyperparameters) under the
    native engine, loaded from ``path`` and trained on steps ``start`` to ``stop``."""

    model, optimizer = native(7, stage, spec)
    for group in optimizer.param_groups:  # the checkpoint must put the saved values back
        group["lr"], group["weight_decay"] = 1.0, 0.5
    metadata = zerobridge.load_checkpoint(path, model, optimizer)
    losses = train_steps(model, optimizer, range(start, stop), clip_native)
    return {"metadata": metadata, "losses": losses, "full": zerobridge.full_state_dict(model)}
