"""Give a meta-device model real values before DeepSpeed takes it, one module at a time.

    >>> import torch
    >>> from zerobridge.backends.deepspeed.materialize import compute_dtype
    >>> compute_dtype({"bf16": {"enabled": True}, "fp16": {"enabled": False}})
    torch.bfloat16

Stages 0-2 hold every parameter on every rank: each module's tensors come
from the construction replay (``zerobridge/runtime/deferred_init.py``) and replace the
meta ones in place (``torch.utils.swap_tensors``, so the optimizer built on
the meta parameters holds the real ones), and the model goes to
``deepspeed.initialize`` as an eager one would.

Stage 3 partitions while materializing, as ``deepspeed.zero.Init`` does for
a model built under it: each parameter, once real, is converted to a ZeRO
parameter (the first through ``deepspeed.zero.Init(module=...)``, the rest
through the ``convert_to_zero_parameters`` DeepSpeed attaches to every ZeRO
parameter), which keeps this rank's partition and frees the full tensor; no
rank holds more than its partitions plus one module's full tensors.
``deepspeed.initialize`` then sees a ZeRO-Init model and neither casts nor
broadcasts it, so parameters are cast to the compute dtype first.

DeepSpeed in bf16 builds its fp32 masters from the bf16 cast;
``restore_masters`` writes the eager fp32 values back, replayed module by
module again (the replay reproduces them at any time) instead of a full
fp32 copy kept across ``initialize``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.runtime.deferred_init import Replay

__all__ = ["Partitioner", "compute_dtype", "materialize_deepspeed", "restore_masters"]


def compute_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed computes in under ``config`` (``None``: the model's own)."""
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


class Partitioner:
    """Turns real parameters into ZeRO-3 partitioned ones, as ``deepspeed.zero.Init`` would."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.first: nn.Parameter | None = None

    def __call__(self, params: list[nn.Parameter]) -> None:
        import deepspeed

        if self.first is None:
            # zero.Init reads the world size from deepspeed.comm: bring it up on the existing group first.
            deepspeed.init_distributed(dist_backend=dist.get_backend())
            deepspeed.zero.Init(module=nn.ParameterList(params), config_dict_or_path=self.config)
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)  # type: ignore[attr-defined]


def materialize_deepspeed(model: nn.Module, replay: Replay, device: torch.device, *, dtype: torch.dtype | None,
                          partitioner: Partitioner | None) -> None:
    """Put the eager values of every meta tensor in place on ``device`` (floating parameters in
    ``dtype`` when given), one module at a time; with a ``partitioner``, partition each
    parameter as soon as it is real. Collective with a partitioner (every rank, same order)."""
    with torch.no_grad():
        for key, value in replay.by_module():
            owner, attr, is_buffer = replay.first[key]
            if is_buffer:
                replay.put_buffer(key, value, device)
                continue
            param = owner._parameters[attr]
            assert param is not None
            real = value.to(device, dtype if dtype is not None and value.is_floating_point() else value.dtype)
            torch.utils.swap_tensors(param, nn.Parameter(real, requires_grad=param.requires_grad))
            del real, value
            if partitioner is not None:
                partitioner([param])


def restore_masters(replay: Replay, internals: Any) -> None:
    """Write the eager fp32 value of every trainable parameter into DeepSpeed's masters (and its
    compute copy), one module at a time. Collective at stage 3."""
    trainable = {key for key, (owner, attr, is_buffer) in replay.first.items()
                 if not is_buffer and owner._parameters[attr] is not None
                 and owner._parameters[attr].requires_grad}  # type: ignore[union-attr]
    for key, value in replay.by_module(trainable.__contains__):
        internals.set_masters({key: value.to(torch.float32)})
