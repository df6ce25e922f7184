"""Where each backend keeps the runs ``load_pretrained`` writes.

    >>> import torch, zerobridge
    >>> from zerobridge.backends import backend_of
    >>> model = zerobridge.prepare(torch.nn.Linear(3, 2), stage=3)
    >>> [(t.names, t.shape, t.start, t.numel) for t in backend_of(model).pretrained_targets()]
    [(('weight',), (2, 3), 0, 6), (('bias',), (2,), 0, 2)]

Native engine: one target per parameter run (``engine/access.py``), written
into the master elements wherever they live, then pushed to the compute
copies. FSDP2: one per DTensor's local shard (a row range of dim 0). Buffers
in the state dict: whole, on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from zerobridge.engine.engine import Engine

__all__ = ["Target", "buffer_targets", "dtensor_targets", "engine_targets"]


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
            targets.append(Target((name,), tuple(buf.shape), 0, buf.numel(),
                                  lambda values, b=buf: b.copy_(values.view(b.shape))))
    return targets


def engine_targets(engine: Engine) -> list[Target]:
    """Every parameter run of the native engine on this rank, then the buffers."""
    from zerobridge.engine.access import local_runs, write_master

    runs = [Target(run.names, tuple(run.shape), run.start, run.numel, functools.partial(write_master, engine, run))
            for run in local_runs(engine)]
    return runs + buffer_targets(engine.model)


def dtensor_targets(model: nn.Module) -> list[Target]:
    """Each parameter's local shard (DTensor: the rows of dim 0 it holds), then the buffers."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    targets = []
    for key, param in params.items():
        shape = tuple(param.shape)
        if isinstance(param, DTensor):
            local = param.to_local()
            local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                        param.placements)
            row = 1
            for d in shape[1:]:
                row *= d
            start = offset[0] * row if shape else 0
        else:
            local, start = param.data, 0
        targets.append(Target(tuple(names[key]), shape, start, local.numel(),
                              lambda values, t=local: t.view(-1).copy_(values)))
    return targets + buffer_targets(model)
