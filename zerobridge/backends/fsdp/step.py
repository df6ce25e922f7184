"""The native engine's step rules around torch FSDP2: accumulation, averaging, clipping, fp16 scaling.

    >>> from zerobridge.backends.fsdp.step import FsdpStepper
    >>> FsdpStepper.__doc__.split(".")[0]
    'Gradient accumulation and the optimizer step of one FSDP2 model, as the native engine does them'

[Note: an FSDP2 step under zerobridge]
forward  root output: scaled by the loss scale (fp16), hooked for backward.
backward first output hook: decide whether this micro-step reduces (the
         accumulation boundary, or every micro-step when the spec says so and
         no ``no_sync`` is open) and tell FSDP2 with
         ``set_requires_gradient_sync``. FSDP2 averages the reduced gradients
         over the ranks. A callback queued behind FSDP2's own end-of-backward
         callback closes the micro-step: reduced shards of a micro-step that is
         not the boundary are put aside (so that a ``zero_grad()`` between
         micro-steps cannot drop them) and added back at the boundary.
step     global optimizer hooks: outside a boundary the step is a no-op; at
         the boundary gradients are divided by the accumulation steps (the
         native rule: world x accumulation in all) and unscaled, non-finite
         steps are skipped (fp16 or ``skip_nonfinite_steps``), and the spec's
         ``clip_grad_norm`` applies before the user's step runs.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils import _pytree as pytree

from zerobridge.runtime.loss_scale import LossScaler, ScaleGrad
from zerobridge.runtime.plan import RunPlan
from zerobridge.runtime.step_rules import apply_clip, hide_grads, nonfinite_flag, norm_part
from zerobridge.runtime.tensors import host_flags, local_tensor
from zerobridge.runtime.window import AccumulationWindow, no_gradients

__all__ = ["FsdpStepper"]


class FsdpStepper:
    """Gradient accumulation and the optimizer step of one FSDP2 model, as the native engine does them."""

    def __init__(self, model: nn.Module, plan: RunPlan, shard_group: dist.ProcessGroup) -> None:
        self.root = model
        self.plan = plan
        self.shard_group = shard_group
        self.params = list(dict.fromkeys(model.parameters()))
        self.param_ids = {id(p) for p in self.params}
        self.scaler = LossScaler(plan.loss_scaling)
        self.skipped_steps = 0
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.window = AccumulationWindow(plan.accumulation_steps, plan.grad_sync)
        self.set_aside: dict[int, torch.Tensor] = {}
        """Reduced gradient shards of earlier micro-steps of this window."""
        self.awaiting: set[int] = set()
        """Parameters whose boundary gradients no optimizer has stepped on yet."""
        self.finalized = False
        self.skip = False
        model.register_forward_hook(self._post_forward)

    # ------------------------------------------------------------------ micro-steps

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        if self.scaler.enabled:
            output = pytree.tree_map(lambda t: ScaleGrad.apply(t, self.scaler.scale)
                                     if isinstance(t, torch.Tensor) and t.requires_grad else t, output)
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.window.in_backward:
            return
        self.window.begin()
        assert isinstance(self.root, FSDPModule)
        self.root.set_requires_gradient_sync(self.window.reduces)
        engine = torch.autograd.Variable._execution_engine
        # Queued from a callback, so that it runs after FSDP2's own end-of-backward callback.
        engine.queue_callback(lambda: engine.queue_callback(self._end_of_backward))

    def _end_of_backward(self) -> None:
        if not self.window.end():
            for p in self.params:
                if p.grad is not None:
                    kept = self.set_aside.get(id(p))
                    if kept is None:
                        self.set_aside[id(p)] = p.grad
                    else:
                        local_tensor(kept).add_(local_tensor(p.grad))
                    p.grad = None
            return
        for p in self.params:
            kept = self.set_aside.pop(id(p), None)
            if kept is not None:
                if p.grad is not None:
                    local_tensor(kept).add_(local_tensor(p.grad))
                p.grad = kept
        self.awaiting = {id(p) for p in self.params if p.grad is not None}
        self.finalized = False

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate locally: the next backward outside reduces everything."""
        return self.window.no_sync()

    # ------------------------------------------------------------------ step

    def _grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self.params if p.grad is not None and id(p) in self.awaiting]

    def finalize(self) -> bool:
        """Average over accumulation steps, unscale, check for overflow (once per boundary).
        Returns whether there are gradients to step on."""
        if not self.awaiting:
            return False
        if self.finalized:
            return True
        self.finalized = True
        grads = self._grads()
        factor = 1.0 / (self.plan.accumulation_steps * self.scaler.scale)
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
        self.skip = False
        if self.scaler.enabled or self.plan.skip_nonfinite_steps:
            flag = nonfinite_flag(grads, grads[0].device if grads else None)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.skip = host_flags(flag.reshape(1), nonfinite_last=True)[0] > 0  # a plan's fake run: no overflow
            self.scaler.update(found_inf=self.skip)
            self.skipped_steps += int(self.skip)
        return True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm (every rank, every shard) is at most
        ``max_norm``; return the norm before clipping, a plain tensor. torch's formula."""
        if not self.finalize():
            raise no_gradients()
        grads = self._grads()
        total = norm_part(grads, norm_type, grads[0].device if grads else torch.device("cpu"))
        if self.shard_group.size() > 1:  # shards of one copy add up; replicas hold the same shards
            dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM,
                            group=self.shard_group)
        return apply_clip(grads, total, max_norm, norm_type)

    def before_step(self, optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        """Pre-step hook: a no-op step (gradients hidden) outside a boundary or on a skipped
        step; else finalize and apply the spec's clipping. Returns what was hidden."""
        self.optimizers.add(optimizer)
        if self.finalize() and not self.skip:
            if self.plan.clip_grad_norm is not None:
                self.clip_grad_norm(self.plan.clip_grad_norm)
            return []
        return hide_grads(optimizer, self.param_ids)

    def after_step(self, optimizer: torch.optim.Optimizer, hidden: list[tuple[nn.Parameter, torch.Tensor | None]]
                   ) -> None:
        """Post-step hook: the stepped parameters' gradients are used up."""
        for param, grad in hidden:
            param.grad = grad
        if self.skip:
            self.awaiting.clear()
            return
        self.awaiting -= {id(p) for group in optimizer.param_groups for p in group["params"]}
