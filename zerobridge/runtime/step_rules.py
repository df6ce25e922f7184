"""The step rules every backend applies between backward and the optimizer, the same way.

    >>> import torch
    >>> from zerobridge.runtime.step_rules import apply_clip, norm_part
    >>> grads = [torch.full((4,), 3.0), torch.full((4,), 4.0)]
    >>> part = norm_part(grads, 2.0, torch.device("cpu"))        # this rank's sum of squares (float64)
    >>> float(apply_clip(grads, part, max_norm=5.0, norm_type=2.0)), round(float(grads[0][0]), 4)
    (10.0, 1.5)

A global gradient norm is assembled from each rank's ``norm_part`` (summed
over the shards of one copy by an all-reduce the caller issues on its own
group), then ``apply_clip`` scales by torch's formula. ``nonfinite_flag``
gives the overflow flag to all-reduce with MAX. The user keeps a plain
torch optimizer: ``install_optimizer_hooks`` registers torch's global
optimizer step hooks once per process, and each backend's stepper
(``StepHooks``) gets ``before_step``/``after_step`` for the optimizers that
hold its parameters; ``hide_grads`` takes gradients out of a step that must
not touch them (no accumulation boundary yet, or a skipped step), and
``raw_step`` runs an optimizer's own step without the hooks.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Hidden", "StepHooks", "apply_clip", "clip_coef", "combine_norms", "grad_norms", "hide_grads",
           "install_optimizer_hooks", "nonfinite_flag", "norm_part", "raw_step"]

Hidden = list[tuple[nn.Parameter, torch.Tensor | None]]


def hide_grads(optimizer: torch.optim.Optimizer, ids: set[int]) -> Hidden:
    """Take the gradients of ``optimizer``'s parameters whose ids are in ``ids`` out of its
    sight (``param.grad = None``); what was taken, to put back after its step."""
    hidden: Hidden = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in ids:
                hidden.append((param, param.grad))
                param.grad = None
    return hidden


def nonfinite_flag(grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """``[1.0]`` when any of this rank's gradients holds an inf or NaN, else ``[0.0]`` (to all-reduce
    with MAX). Computed where the gradients are, without reading anything back to the host."""
    bad = [(~torch.isfinite(g)).any().reshape(1).to(device=device, dtype=torch.float32) for g in grads]
    return torch.cat(bad).amax(0, keepdim=True) if bad else torch.zeros(1, device=device)


_NORM_CHUNK = 1 << 22
"""Elements cast to float64 at a time by ``_float64_norm`` (32 MiB)."""


def _float64_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``grad``'s ``norm_type``-norm accumulated in float64, cast a chunk at a time so that
    no float64 copy of a large gradient is ever held whole."""
    norm: torch.Tensor
    if grad.numel() <= _NORM_CHUNK:  # over every element whatever the shape: no flattening view
        norm = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64)
        return norm
    chunks = torch.split(grad.reshape(-1), _NORM_CHUNK)
    parts = torch.stack([torch.linalg.vector_norm(c, norm_type, dtype=torch.float64) for c in chunks])
    norm = torch.linalg.vector_norm(parts, norm_type)
    return norm


def grad_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's ``norm_type``-norm, float64: ``norm_part``'s terms, for callers that see
    the gradients a few at a time (``combine_norms`` sums them as ``norm_part`` does)."""
    return [_float64_norm(g, norm_type) for g in grads]


def combine_norms(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``norm_part`` from the ``grad_norms`` of every gradient, in the same order."""
    if norms:
        stacked = torch.stack(norms)
        local = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    return local.reshape(1).to(device, torch.float64)


def norm_part(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the global gradient norm, ``[1]`` float64 on ``device``: the sum of
    the ``norm_type``-th powers of its gradients' norms (their largest for the inf-norm).

    Every norm is accumulated in float64, and the part is all-reduced in float64: in
    float32 the rounding of sums over tens of millions of elements depends on how the
    elements are split into shards, so sharding alone would move the norm (by 1e-5 at
    20M parameters) and, through clipping, the losses."""
    return combine_norms(grad_norms(grads, norm_type), norm_type, device)


def clip_coef(reduced: torch.Tensor, max_norm: float, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global norm from the all-reduced ``norm_part`` (SUM, or MAX for the inf-norm) and the
    float64 factor that brings it to at most ``max_norm`` (torch's formula)."""
    total = reduced[0] if norm_type == float("inf") else reduced[0].pow(1.0 / norm_type)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def apply_clip(grads: list[torch.Tensor], reduced: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
    """Scale ``grads`` by ``clip_coef`` (cast to their dtype, as torch does); return the norm
    before, as float32 (what torch returns for float32 gradients)."""
    total, coef = clip_coef(reduced, max_norm, norm_type)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
    return total.to(torch.float32)


_QUIET = 0
"""Depth of ``raw_step`` calls: the engine's own steps do not run the hooks again."""


def raw_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the step hooks (torch's, per optimizer, or an LR
    scheduler's counter): the function torch wrapped, under a re-entrancy guard for
    subclasses whose ``step`` calls a hooked ``super().step()``."""
    global _QUIET
    step = type(optimizer).step
    function = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step
    _QUIET += 1
    try:
        function(optimizer)
    finally:
        _QUIET -= 1


class StepHooks(Protocol):
    """What the process-wide step hooks call: the native ``NativeStepper`` and other
    backends' stepping objects (``zerobridge/backends/fsdp/step.py``)."""

    param_ids: set[int]

    def before_step(self, optimizer: torch.optim.Optimizer) -> Any: ...

    def after_step(self, optimizer: torch.optim.Optimizer, stash: Any) -> None: ...


_CONTROLS: weakref.WeakSet[StepHooks] = weakref.WeakSet()
_INSTALLED = False


def install_optimizer_hooks(control: StepHooks) -> None:
    """Register ``control`` with the process-wide optimizer step hooks: before each
    ``step()`` of an optimizer holding its parameters it gets ``before_step``, after
    it ``after_step`` with what ``before_step`` returned."""
    global _INSTALLED
    _CONTROLS.add(control)
    if _INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    # Per optimizer a stack: a subclass's step calling a hooked super().step() nests.
    stashes: dict[int, list[list[tuple[StepHooks, Any]]]] = {}

    def owners(optimizer: torch.optim.Optimizer) -> list[StepHooks]:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [c for c in list(_CONTROLS) if not ids.isdisjoint(c.param_ids)]

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _QUIET:
            entry = [(c, c.before_step(optimizer)) for c in owners(optimizer)]
            stashes.setdefault(id(optimizer), []).append(entry)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stack = stashes.get(id(optimizer))
        if _QUIET or not stack:
            return
        for control, stash in stack.pop():
            control.after_step(optimizer, stash)
        if not stack:
            del stashes[id(optimizer)]

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    _INSTALLED = True
