"""What the engine puts around a unit's forward: its inputs cast, its forward
recomputed in backward, and a signal when the gradients of its inputs are computed.

    >>> import torch
    >>> from zerobridge.runtime.unit_wrap import after_inputs_backward, cast_floats
    >>> cast_floats((torch.ones(2), {"mask": torch.ones(2, dtype=torch.bool)}), torch.bfloat16)[0].dtype
    torch.bfloat16
    >>> done = []
    >>> x = torch.ones(3, requires_grad=True)
    >>> (y,), _ = after_inputs_backward(((x,), {}), lambda: done.append(True))
    >>> (y * 2).sum().backward()
    >>> done, x.grad.tolist()
    ([True], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

__all__ = ["CACHE_KWARGS", "after_inputs_backward", "cast_floats", "checkpointed"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients are computed,
    that is after the unit's own backward."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *tensors: torch.Tensor) -> Any:
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.hook()
        return (None, *grads)


def after_inputs_backward(tree: Any, hook: Any) -> Any:
    """``tree`` with its tensors that require grad passed through one ``_PostBackward``:
    ``hook()`` runs once in backward, after all of their gradients. Nothing requires
    grad: ``tree`` as is, and the hook never runs."""
    leaves, spec = pytree.tree_flatten(tree)
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return tree
    outs = _PostBackward.apply(  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
        hook, *(leaves[i] for i in at))
    for i, out in zip(at, outs):
        leaves[i] = out
    return pytree.tree_unflatten(leaves, spec)


CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
"""The names Hugging Face layers take a KV cache under."""


def checkpointed(forward: Any) -> Any:
    """``forward`` with its activations recomputed in backward instead of kept.

    A KV cache handed to the unit (a Hugging Face model in training mode with
    ``config.use_cache`` on) is dropped while gradients are recorded, as
    transformers' own gradient checkpointing does, with a warning once: every
    layer would otherwise keep its keys and values in the cache, alive through
    the whole backward, and append them again when backward recomputes it (a
    Llama-3-8B-shaped model at stage 3 held 0.2 GB more per layer in backward
    for it). Without gradients (evaluation, ``generate()``) the cache is left as
    it is."""
    warned: list[bool] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            dropped = [k for k in CACHE_KWARGS if kwargs.get(k) is not None]
            for key in dropped:
                kwargs[key] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
                dropped.append("use_cache")
            if dropped and not warned:
                warned.append(True)
                warnings.warn(f"activation checkpointing: {', '.join(dropped)} dropped from the unit's forward while "
                              "training (a KV cache would keep every layer's keys and values through backward); set "
                              "model.config.use_cache = False for training to silence this", stacklevel=2)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype``."""
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           tree)
