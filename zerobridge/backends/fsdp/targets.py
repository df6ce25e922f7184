"""The runs ``load_pretrained`` writes on torch FSDP2: each parameter's local shard, a row range of dim 0.

A ``DTensor`` sharded on dim 0 holds rows ``[offset, offset + local rows)``,
which is elements ``[offset x row, ...)`` of the flattened parameter: one
target per parameter, written in place into the local shard.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zerobridge.pretrained.targets import Target, buffer_targets

__all__ = ["dtensor_targets"]


def dtensor_targets(model: nn.Module) -> list[Target]:
    """Each parameter's local shard (DTensor: the rows of dim 0 it holds), then the buffers."""
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
        targets.append(Target(tuple(names[key]), shape, start, local.numel(), functools.partial(_write_flat, local)))
    return targets + buffer_targets(model)


def _write_flat(local: torch.Tensor, values: torch.Tensor) -> None:
    local.view(-1).copy_(values)
