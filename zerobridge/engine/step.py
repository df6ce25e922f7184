"""Between backward and the optimizer: unscale, overflow check, clipping, and the
optimizer hooks that skip steps and refresh compute parameters afterwards.

    >>> from zerobridge.engine.step import StepControl
    >>> StepControl.__doc__.split(".")[0]
    'What happens around optimizer'

The user keeps a plain torch optimizer. Global optimizer step hooks find the
engines that own its parameters: before the step they finalise the
gradients (or hide them when the step must be skipped: fp16 overflow, or no
accumulation boundary reached); after it they push the stepped master values
into the compute parameters (and, replicated, all-gather them). With the
optimizer tier on nvme the pre-hook itself steps the engine's parameters tile
by tile (``swap.py``, calling the optimizer's own step without these hooks)
and hides their gradients, so the user's ``step()`` moves only the others.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.engine import collectives
from zerobridge.engine.collectives import CommStats, Pending
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.handing import drop_grads, materialize_grads
from zerobridge.engine.loss_scale import LossScaler
from zerobridge.engine.master import push_master
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.plan import EnginePlan
from zerobridge.engine.swap import StateSwapper

__all__ = ["StepControl", "StepHooks", "apply_clip", "hide_grads", "install_optimizer_hooks", "nonfinite_flag",
           "norm_part", "raw_step"]

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
    flat = grad.reshape(-1)
    if flat.numel() <= _NORM_CHUNK:
        return torch.linalg.vector_norm(flat, norm_type, dtype=torch.float64)
    parts = torch.stack([torch.linalg.vector_norm(c, norm_type, dtype=torch.float64) for c in flat.split(_NORM_CHUNK)])
    return torch.linalg.vector_norm(parts, norm_type)


def norm_part(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the global gradient norm, ``[1]`` float64 on ``device``: the sum of
    the ``norm_type``-th powers of its gradients' norms (their largest for the inf-norm).

    Every norm is accumulated in float64, and the part is all-reduced in float64: in
    float32 the rounding of sums over tens of millions of elements depends on how the
    elements are split into shards, so sharding alone would move the norm (by 1e-5 at
    20M parameters) and, through clipping, the losses."""
    if grads:
        norms = torch.stack([_float64_norm(g, norm_type) for g in grads])
        local = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    return local.reshape(1).to(device, torch.float64)


def apply_clip(grads: list[torch.Tensor], reduced: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
    """The global norm from the all-reduced ``norm_part`` (SUM, or MAX for the inf-norm); scale
    ``grads`` so that it is at most ``max_norm`` (torch's formula, in float64); return the
    norm before, as float32 (what torch returns for float32 gradients)."""
    total = reduced[0] if norm_type == float("inf") else reduced[0].pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
    return total.to(torch.float32)


@dataclass
class Stash:
    """What the pre-step hook did for one optimizer."""

    stepping: bool
    """The engine's parameters step now (else the step is skipped for them)."""
    hidden: Hidden = field(default_factory=list)
    """Gradients hidden from the user's step."""
    swapped: bool = False
    """The pre-hook already stepped them tile by tile (nvme optimizer tier)."""
    nested: bool = False
    """A step inside this optimizer's own step (a subclass calling a hooked
    ``super().step()`` runs torch's hooks twice): the outer call decides."""


class StepControl:
    """What happens around optimizer.step() for one engine."""

    def __init__(self, plan: EnginePlan, mesh: Mesh, stats: CommStats, trainable: list[FlatGroup],
                 swapper: StateSwapper | None = None) -> None:
        self.plan = plan
        self.mesh = mesh
        self.stats = stats
        self.trainable = trainable
        self.swapper = swapper
        self.param_ids = {id(p) for g in trainable for p in g.params}
        self.scaler = LossScaler(plan.loss_scaling)
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.awaiting: set[int] = set()
        """Groups holding gradients no optimizer has stepped on yet."""
        self.finalized = False
        self.skip = False
        self.found_nonfinite = False
        """Some rank's reduced gradients held an inf or NaN (read with the used flags, ``checks_nonfinite``)."""
        self.skipped_steps = 0
        self.depth: dict[int, int] = {}
        """Nesting of each optimizer's step (by id) now."""

    @property
    def checks_nonfinite(self) -> bool:
        """Steps with an inf or NaN gradient are skipped (loss scaling, or the spec says so)."""
        return self.scaler.enabled or self.plan.skip_nonfinite_steps

    def gradients_ready(self, *, found_nonfinite: bool = False) -> None:
        """An accumulation boundary handed every group its gradients; ``found_nonfinite``: the
        all-reduced overflow flag the engine read together with the used flags."""
        self.found_nonfinite = found_nonfinite
        self.awaiting = {id(g) for g in self.trainable}
        self.finalized = False
        self.depth.clear()  # a step that raised half way is over

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.trainable for p in g.params if p.grad is not None]

    def _device(self) -> torch.device:
        return self.trainable[0].full.device if self.trainable else torch.device("cpu")

    def finalize(self) -> bool:
        """Unscale and check for overflow (once per boundary).
        Returns whether there are gradients to step on."""
        if not self.awaiting:
            return False
        if self.finalized:
            return True
        self.finalized = True
        scale = self.scaler.scale
        self.skip = self.checks_nonfinite and self.found_nonfinite
        if self.checks_nonfinite:
            self.scaler.update(found_inf=self.skip)
            self.skipped_steps += int(self.skip)
        if self.skip:
            return True
        for group in self.trainable:  # deferred gradients exist from here to the end of the step
            materialize_grads(group)
        grads = self._grads()
        if self.scaler.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / scale)
        return True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm (every rank, every shard) is at most
        ``max_norm``; return the norm before clipping. torch's formula."""
        if not self.finalize():
            raise RuntimeError("clip_grad_norm_ needs gradients: call it after backward at an accumulation "
                               "boundary (outside no_sync), before optimizer.step()")
        grads = self._grads()
        local = norm_part(grads, norm_type, self._device())
        # Shards of one copy are summed; replicas hold the same shard and are not.
        collectives.all_reduce(local, self.mesh.reduce, self.stats,
                               op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
        return apply_clip(grads, local, max_norm, norm_type)

    def before_step(self, optimizer: torch.optim.Optimizer) -> Stash:
        """Optimizer pre-step hook: skip (hide gradients), let the step run, or run it
        here tile by tile when the optimizer state is on nvme."""
        self.optimizers.add(optimizer)
        depth = self.depth.get(id(optimizer), 0)
        self.depth[id(optimizer)] = depth + 1
        if depth:
            return Stash(stepping=False, nested=True)
        if not self.finalize() or self.skip:
            return Stash(stepping=False, hidden=hide_grads(optimizer, self.param_ids))
        if self.plan.clip_grad_norm is not None:  # the spec's clipping, at step time as DeepSpeed does
            self.clip_grad_norm(self.plan.clip_grad_norm)
        if self.swapper is None:
            return Stash(stepping=True)
        hidden = hide_grads(optimizer, self.param_ids)
        self.swapper.step(optimizer, {id(p): g for p, g in hidden}, raw_step)
        return Stash(stepping=True, hidden=hidden, swapped=True)

    def after_step(self, optimizer: torch.optim.Optimizer, stash: Stash) -> None:
        """Optimizer post-step hook: refresh the compute parameters of stepped groups."""
        self.depth[id(optimizer)] = self.depth.get(id(optimizer), 1) - 1
        if self.depth[id(optimizer)] <= 0:
            del self.depth[id(optimizer)]
        if stash.nested:
            return
        if not stash.stepping or not self.awaiting:
            if self.skip:
                self.awaiting.clear()
                for group in self.trainable:
                    drop_grads(group)
            return
        for param, grad in stash.hidden:  # the tiled step is over: gradients stay visible until zero_grad
            param.grad = grad
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        inflight: list[tuple[int, Pending]] = []
        bound = self.plan.allgather_bucket
        for group in self.trainable:
            if id(group) in self.awaiting and any(id(p) in stepped for p in group.params):
                if not stash.swapped:
                    push_master(group)
                drop_grads(group)
                for numel, work in group.after_step():
                    inflight.append((numel, work))
                    while bound is not None and len(inflight) > 1 and sum(n for n, _ in inflight) > bound:
                        inflight.pop(0)[1].wait()
                self.awaiting.discard(id(group))
        for _, work in inflight:
            work.wait()


_QUIET = 0
"""Depth of ``raw_step`` calls: the engine's own steps do not run the hooks again."""


def raw_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the step hooks (torch's, per optimizer, or an LR
    scheduler's counter): the function torch wrapped, under a re-entrancy guard for
    subclasses whose ``step`` calls a hooked ``super().step()``."""
    global _QUIET
    step = type(optimizer).step
    function = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
    _QUIET += 1
    try:
        function(optimizer)
    finally:
        _QUIET -= 1


class StepHooks(Protocol):
    """What the process-wide step hooks call: the native ``StepControl`` and other
    backends' stepping objects (``zerobridge/backends/fsdp_step.py``)."""

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
