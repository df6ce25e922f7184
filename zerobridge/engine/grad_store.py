"""The optimizer's gradients: from a flat group's gradient store to ``param.grad``.

    >>> import torch, zerobridge
    >>> from zerobridge.spec import PrecisionSpec, StrategySpec
    >>> spec = StrategySpec(precision=PrecisionSpec(param_dtype="bf16", master_dtype="fp32"))
    >>> model = zerobridge.prepare(torch.nn.Linear(2, 1), config=spec)
    >>> model(torch.ones(1, 2)).float().sum().backward()
    >>> [p.grad for p in model.parameters()]          # bf16 in the store, not cast yet
    [None, None]
    >>> _ = zerobridge.clip_grad_norm_(model, 1.0)    # the step (or clipping) asks for them
    >>> [p.grad.dtype for p in model.parameters()]
    [torch.float32, torch.float32]

At an accumulation boundary the engine hands each used parameter its gradient.
When the store's dtype is the master's (and both live on one device) the
parameter's ``.grad`` is a view of the store: nothing is copied. When they
differ, a copy in the master dtype is needed; an offload tier keeps it on the
host from the boundary on (DeepSpeed's fp32 gradient partitions), while on the
device the copy is *deferred*: it is cast from the store only when the step
(or ``clip_grad_norm_``) asks for it and dropped after the step, so the
gradients are never held twice (DeepSpeed: 16-bit gradients, fp32 only while
the optimizer steps). Deferred gradients no step consumed stay in the store and
add up with the next window's, as ``p.grad`` would in torch.

A ``clip_grad_norm_`` call asks for every gradient at once (``materialize_grads``).
The step alone does not, nor does the spec's clipping (applied at step time): each
tile of parameters is cast (``cast_grads``), stepped and dropped in turn, so the
fp32 gradients held at once are one tile's (``step.py``), never all of them
beside the store; a parameter larger than a tile is cast and stepped a range of
its elements at a time when the optimizer allows it (``cast_range``, ``param_range.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerobridge.engine.flat_group import FlatGroup

__all__ = ["Scale", "attach_grads", "cast_grads", "cast_range", "drop_grads", "materialize_grads", "scale_grads"]

Scale = float | torch.Tensor
"""A factor every optimizer gradient is multiplied by once cast: ``1 / loss scale`` (a float), or a
clipping coefficient (a float64 tensor, cast to the gradient's dtype first, as torch clips)."""


def attach_grads(group: FlatGroup, used: Sequence[float]) -> None:
    """At a boundary: give each of ``group``'s sharded parameters used on any rank its gradient
    (in the master dtype), now, or at the step when the gradients are deferred."""
    group.handed = [bool(u) for u in used]
    group.pending = group.deferred_grads
    if group.pending:
        for param in group.params:
            param.grad = None
    else:
        _hand(group)


def materialize_grads(group: FlatGroup) -> None:
    """At the step: cast deferred gradients to the master dtype (until ``drop_grads``)."""
    if group.pending:
        group.pending = False
        _hand(group)


def scale_grads(grads: list[torch.Tensor], scales: Sequence[Scale]) -> None:
    """Multiply ``grads`` in place by each of ``scales`` in turn."""
    for factor in scales:
        if grads:
            torch._foreach_mul_(grads, factor if isinstance(factor, float)
                                else factor.to(grads[0].device, grads[0].dtype))


def cast_grads(group: FlatGroup, indices: Sequence[int], scales: Sequence[Scale]) -> list[torch.Tensor]:
    """At the step, for deferred gradients: give the parameters ``indices`` of ``group`` (those
    handed a gradient) their gradient in the master dtype, each its own tensor, times ``scales``;
    the caller sets ``param.grad = None`` once they are stepped."""
    grads: list[torch.Tensor] = []
    for i in indices:
        param = group.params[i]
        if group.handed[i]:
            param.grad = _cast(group, group.store_view(i)).view(param.shape)
            grads.append(param.grad)
    scale_grads(grads, scales)
    return grads


def cast_range(group: FlatGroup, index: int, start: int, stop: int, scales: Sequence[Scale]) -> list[torch.Tensor]:
    """``cast_grads`` for the elements ``start:stop`` of parameter ``index`` alone, while the optimizer
    sees the parameter narrowed to them (``param_range.py``): its flat gradient, or none if not handed."""
    if not group.handed[index]:
        return []
    param = group.params[index]
    param.grad = _cast(group, group.store_view(index)[start:stop])
    grads = [param.grad]
    scale_grads(grads, scales)
    return grads


def _cast(group: FlatGroup, stored: torch.Tensor) -> torch.Tensor:
    """A new tensor in the master dtype, on the master's device, holding ``stored``'s values."""
    grad = torch.empty(stored.numel(), dtype=group.plan.master_dtype, device=group.master_device)
    return grad.copy_(stored)


def drop_grads(group: FlatGroup) -> None:
    """The step consumed (or skipped) the gradients: drop the optimizer's copies."""
    group.pending = False
    if group.optimizer_grads is not None:
        for param in group.params:
            param.grad = None
        group.optimizer_grads = None


def _hand(group: FlatGroup) -> None:
    plan = group.plan
    cast = plan.accumulate_dtype != plan.master_dtype or group.master_device != group.full.device
    if cast:
        group.optimizer_grads = torch.empty(group.layout.shard_numel, dtype=plan.master_dtype,
                                            device=group.master_device)
    if group.optimizer_grads is None:  # the optimizer steps on the grad store itself, through views made once
        for param, grad, handed in zip(group.params, group.grad_views(), group.handed):
            param.grad = grad if handed else None
        return
    for i, param in enumerate(group.params):
        if not group.handed[i]:
            param.grad = None
            continue
        piece = group.layout.pieces[i]
        grad = group.optimizer_grads[piece.shard_start:piece.shard_stop].copy_(group.store_view(i))
        param.grad = grad.view(param.shape)
