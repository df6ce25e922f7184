"""Where each backend keeps the runs ``load_pretrained`` writes.

    >>> import torch
    >>> from zerobridge.pretrained.targets import buffer_targets
    >>> model = torch.nn.BatchNorm1d(3)
    >>> [(t.names, t.shape, t.start, t.numel) for t in buffer_targets(model)]
    [(('running_mean',), (3,), 0, 3), (('running_var',), (3,), 0, 3), (('num_batches_tracked',), (), 0, 1)]

Each backend lists its own (``Backend.pretrained_targets``): the native
engine one target per parameter run (``backends/native/targets.py``),
written into the master elements wherever they live; FSDP2 one per
DTensor's local shard, a row range of dim 0 (``backends/fsdp/targets.py``).
Buffers in the state dict: whole, on every rank (``buffer_targets``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Target", "buffer_targets"]


@dataclass(frozen=True)
class Target:
    """A run of one tensor this rank holds: elements ``[start, start + numel)`` of it flattened."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    start: int
    numel: int
    write: Callable[[torch.Tensor], None]
    """Takes the run's values (1-D, any dtype) and stores them."""


def buffer_targets(model: nn.Module) -> list[Target]:
    """The model's persistent buffers, whole."""
    persistent = set(model.state_dict(keep_vars=True))
    targets = []
    for name, buf in model.named_buffers():
        if name in persistent:
            targets.append(Target((name,), tuple(buf.shape), 0, buf.numel(), functools.partial(_write_whole, buf)))
    return targets


def _write_whole(buf: torch.Tensor, values: torch.Tensor) -> None:
    buf.copy_(values.view(buf.shape))
