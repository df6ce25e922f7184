"""The engine: hooks that run any partitioning plan on an unchanged model.

    >>> import torch, zerobridge
    >>> model = zerobridge.prepare(torch.nn.Linear(4, 2), stage=2)   # world size 1 without a launcher
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> [p.grad.shape for p in model.parameters()]
    [torch.Size([2, 4]), torch.Size([2])]

Calls go one way: the hooks here drive units, units drive flat groups
(``flat_group.py``), flat groups issue collectives (``collectives.py``).

[Note: life of a step]
forward  root pre-hook: cast inputs, show the replicated group's views.
         unit pre-hook: all-gather the unit (sharded groups), prefetch the
         next one, show full-shape views; post-hook: hide them, free the
         gathered buffer if resharding after forward, hook the outputs.
backward first output hook: open the micro-step (decide whether to reduce),
         queue the end-of-backward callback. Unit output hook: gather again
         (resharded units), prefetch the next unit in backward order. Bucket
         leaf hook: reduce the bucket (in a fixed order on every rank) or
         accumulate it locally; free a unit once all its buckets fired.
end      launch what never fired (unused parameters), land every reduction,
         free everything, and at an accumulation boundary agree on which
         parameters were used and hand the optimizer its gradients.
step     global optimizer hooks: unscale and check overflow, clip when the
         spec says, hide gradients when the step must be skipped (or step the
         state tile by tile from nvme, ``swap.py``); after the step push master
         values into the compute parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from zerobridge.engine import collectives
from zerobridge.engine.collectives import CommStats
from zerobridge.engine.flat_group import FlatGroup, GatherState, Reduction
from zerobridge.engine.grouping import build_groups
from zerobridge.engine.loss_scale import ScaleGrad
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.offload import open_spaces
from zerobridge.engine.plan import EnginePlan
from zerobridge.engine.state import full_state_dict, memory
from zerobridge.engine.step import StepControl, install_optimizer_hooks
from zerobridge.engine.swap import StateSwapper
from zerobridge.engine.units import collect_params, owners, unit_modules
from zerobridge.spec import BackwardPrefetch, GradSync, ParamSharding

__all__ = ["Engine", "Unit"]

MAX_INFLIGHT_REDUCTIONS = 2


@dataclass(eq=False)
class Unit:
    """A wrap unit: its sharded groups are gathered and freed together."""

    index: int
    module: nn.Module
    groups: list[FlatGroup] = field(default_factory=list)
    backward_ready: bool = False
    """Its backward gather was issued in the current backward pass."""
    fired: int = 0
    """Trainable buckets whose gradients arrived in this backward pass."""

    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    @property
    def trainable_buckets(self) -> int:
        return sum(len(g.layout.buckets) for g in self.groups if g.plan.trainable)


class Engine:
    """Runs one ``EnginePlan`` on one model. Built by ``zerobridge.prepare``."""

    # ------------------------------------------------------------------ initialization

    def __init__(self, model: nn.Module, plan: EnginePlan, mesh: Mesh, device: torch.device | None = None) -> None:
        """``device``: where a meta-device model's groups go (values: ``engine/materialize.py``)."""
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.device = device or next(model.parameters()).device
        self.stats = CommStats()
        collectives.broadcast_module(model, 0, mesh.control, self.stats)
        if plan.buffer_dtype is not None:
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        module._buffers[name] = buf.to(plan.buffer_dtype)
        refs = collect_params(model)
        modules = unit_modules(model, plan.wrap)
        owner = owners(model, modules, refs)
        self.units = [Unit(i, m) for i, m in enumerate(modules)]
        self.spaces = open_spaces(plan.offload, rank=mesh.rank)
        per_unit, self.replicated = build_groups(refs, owner, len(self.units), plan, mesh, self.stats, self.spaces,
                                                 self.device)
        for unit, groups in zip(self.units, per_unit):
            unit.groups = groups
        self.groups = [g for u in self.units for g in u.groups] + self.replicated
        self.unit_of = {id(g): u for u in self.units for g in u.groups}
        self.trainable = [g for g in self.groups if g.plan.trainable]
        swapper = None
        if self.spaces.optimizer is not None:
            swapper = StateSwapper(self.trainable, self.spaces.optimizer, plan.offload)
        self.stepping = StepControl(plan, mesh, self.stats, self.trainable, swapper)
        # The reduction order every rank follows: buckets whose earliest-registered
        # parameter comes last are expected to finish first in backward.
        order = [(g, b.index, min(g.refs[i].order for i in b.params)) for g in self.trainable
                 for b in g.layout.buckets]
        self.order = [(g, b) for g, b, _ in sorted(order, key=lambda item: -item[2])]
        for group in self.groups:
            group.restore()
            for b, leaf in enumerate(group.leaves):
                if group.plan.trainable:
                    leaf.register_post_accumulate_grad_hook(self._bucket_hook(group, b))
        self._install_hooks()
        # Runtime state.
        self.in_backward = False
        self.no_sync_depth = 0
        self.micro_in_window = 0
        self.window_open = False
        self.reduce_now = False
        self.boundary = False
        self.ready: set[tuple[int, int]] = set()
        self.cursor = 0
        self.pending: list[Reduction] = []
        self.forward_order: list[Unit] = []
        self.previous_order: list[Unit] = []
        self.stats.reset()
        install_optimizer_hooks(self.stepping)

    def _install_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward_hook(unit)), with_kwargs=True, prepend=True)
            unit.module.register_forward_hook(torch.compiler.disable(self._post_forward_hook(unit)), with_kwargs=True)
        if self.plan.activation_checkpointing:
            targets = [u.module for u in self.units[1:]] or [self.model]
            for module in targets:
                module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]

    # ------------------------------------------------------------------ forward

    def _pre_forward_hook(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return self._pre_forward(unit, args, kwargs)
        return hook

    def _post_forward_hook(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            return self._post_forward(unit, output)
        return hook

    def _pre_forward(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grad = torch.is_grad_enabled()
        if unit.index == 0 and not self.in_backward:
            self.previous_order, self.forward_order = self.forward_order or self.previous_order, []
            if self.plan.compute_dtype != torch.float32:
                args, kwargs = _cast_floats((args, kwargs), self.plan.compute_dtype)
            for group in self.replicated:
                group.install(mark_used=grad)
        if not self.in_backward and unit not in self.forward_order:
            self.forward_order.append(unit)
        for group in unit.groups:
            group.unshard(backward=False)
        if self.plan.forward_prefetch and not self.in_backward:
            self._prefetch(unit, self.previous_order, backward=False)
        for group in unit.groups:
            group.wait_unshard()
            group.install(mark_used=grad and not self.in_backward)
        return args, kwargs

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        if self.in_backward:  # recomputation under activation checkpointing
            return output
        grad = torch.is_grad_enabled()
        for group in unit.groups:
            group.restore()
            if not grad or (self.plan.sharding is ParamSharding.RESHARD_AFTER_FORWARD and not self._reused(unit)):
                group.reshard(keep_secondary=grad)
        if unit.index == 0:
            for group in self.replicated:
                group.restore()
            if grad and self.stepping.scaler.enabled:
                output = pytree.tree_map(lambda t: ScaleGrad.apply(t, self.stepping.scaler.scale)
                                         if isinstance(t, torch.Tensor) and t.requires_grad else t, output)
        if grad:
            hook = self._pre_backward_hook(unit)
            for tensor in pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        return output

    def _reused(self, unit: Unit) -> bool:
        """Keep a unit gathered after forward when its backward use comes within
        ``max_reuse_distance`` gathered elements (the last units of forward)."""
        limit = self.plan.max_reuse_distance
        if not limit or unit not in self.previous_order:
            return False
        later = self.previous_order[self.previous_order.index(unit) + 1:]
        return 2 * sum(u.numel for u in later) <= limit

    def _prefetch(self, unit: Unit, order: list[Unit], *, backward: bool) -> None:
        if unit not in order:
            return
        budget = self.plan.prefetch_bucket
        if budget == 0:  # DeepSpeed: a prefetch bucket of 0 turns prefetching off
            return
        live_cap = self.plan.max_live_parameters
        inflight_cap = self.plan.max_inflight_gathers
        live = sum(g.gathered_numel for g in self.groups)
        inflight = sum(1 for u in self.units if any(g.state is GatherState.GATHERING for g in u.groups))
        issued = 0
        start = order.index(unit) + 1
        for nxt in order[start:start + 1] if budget is None else order[start:]:
            numel = nxt.numel
            if issued and budget is not None and issued + numel > budget:
                break
            if live_cap is not None and live + numel > live_cap:
                break
            if inflight_cap is not None and inflight >= inflight_cap:
                break
            if all(g.state is not GatherState.SHARDED for g in nxt.groups):
                continue  # already gathered or on its way
            inflight += 1
            for group in nxt.groups:
                group.unshard(backward=backward)
            issued += numel
            live += numel

    # ------------------------------------------------------------------ backward

    def _pre_backward_hook(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(unit)
        return hook

    def _begin_backward(self) -> None:
        self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)  # type: ignore[attr-defined]
        syncing = self.no_sync_depth == 0
        self.boundary = syncing and self.micro_in_window + 1 >= self.plan.accumulation_steps
        self.reduce_now = self.boundary or (syncing and self.plan.grad_sync is GradSync.EVERY_MICRO_STEP)
        if not self.window_open:
            single_reduce = self.plan.grad_sync is GradSync.ACCUMULATION_BOUNDARY or self.plan.accumulation_steps == 1
            for group in self.trainable:
                group.begin_window(single_reduce=single_reduce)
            self.window_open = True
        self.ready.clear()
        self.cursor = 0

    def _pre_backward(self, unit: Unit) -> None:
        if not self.in_backward:
            self._begin_backward()
        if unit.backward_ready:
            return
        unit.backward_ready = True
        with torch.enable_grad():  # views for recomputation must match the original forward
            if unit.index == 0:
                for group in self.replicated:
                    group.install(mark_used=False)
            for group in unit.groups:
                group.unshard(backward=True)
            if self.plan.backward_prefetch is BackwardPrefetch.BEFORE_GRAD:
                self._prefetch(unit, self.forward_order[::-1], backward=True)
            for group in unit.groups:
                group.wait_unshard()
                group.install(mark_used=False)

    def _bucket_hook(self, group: FlatGroup, b: int) -> Any:
        # Weak references: torch's garbage collector does not look inside a tensor's
        # post-accumulate hooks, so a strong one would keep the engine (its memory
        # and its swap files) alive for good.
        engine, weak_group = weakref.ref(self), weakref.ref(group)

        def hook(leaf: torch.Tensor) -> None:
            alive, owner = engine(), weak_group()
            if alive is not None and owner is not None:
                alive._on_bucket_grad(owner, b)
        return hook

    def _on_bucket_grad(self, group: FlatGroup, b: int) -> None:
        if not self.in_backward:
            self._begin_backward()
        if self.reduce_now:
            self.ready.add((id(group), b))
            if self.plan.overlap_reduce:
                self._launch_ready()
        else:
            group.accumulate_local(b)
        unit = self.unit_of.get(id(group))
        if unit is None:
            return
        unit.fired += 1
        if unit.fired == unit.trainable_buckets and self.plan.sharding.sharded_at_rest:
            for g in unit.groups:
                if g.plan.trainable:
                    g.restore()
                    g.reshard(keep_secondary=False)
            if self.plan.backward_prefetch is BackwardPrefetch.AFTER_GRAD:
                self._prefetch(unit, self.forward_order[::-1], backward=True)

    def _launch_ready(self, *, flush: bool = False) -> None:
        while self.cursor < len(self.order):
            group, b = self.order[self.cursor]
            if not flush and (id(group), b) not in self.ready:
                return
            self.pending.append(group.reduce(b, self.plan.gradient_divisor))
            self.cursor += 1
            # At most two reductions in flight (the order is the same on every rank):
            # a bucket's full gradient is freed once its reduction has landed.
            while len(self.pending) > MAX_INFLIGHT_REDUCTIONS:
                self._land(self.pending.pop(0))

    @staticmethod
    def _land(reduction: Reduction) -> None:
        reduction.work.wait()
        reduction.finish()

    def _end_of_backward(self) -> None:
        if self.reduce_now:
            self._launch_ready(flush=True)
        for reduction in self.pending:
            self._land(reduction)
        self.pending.clear()
        for unit in self.units:
            for group in unit.groups:
                group.restore()
                group.reshard(keep_secondary=False)
            unit.backward_ready = False
            unit.fired = 0
        for group in self.replicated:
            group.restore()
        self.micro_in_window += 1
        if self.boundary:
            self._close_window()
        self.in_backward = False

    def _close_window(self) -> None:
        used = torch.cat([g.used for g in self.trainable]) if self.trainable else torch.zeros(0)
        flags = used.to(self.groups[0].full.device)
        collectives.all_reduce(flags, self.mesh.control, self.stats, op=torch.distributed.ReduceOp.MAX)
        start = 0
        for group in self.trainable:
            count = len(group.refs)
            group.attach_grads(flags[start:start + count].cpu())
            group.end_window()
            start += count
        self.stepping.gradients_ready()
        self.window_open = False
        self.micro_in_window = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces them all."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    # ------------------------------------------------------------------ step and state

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks; return that norm."""
        return self.stepping.clip_grad_norm(max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded master values under every original name, with buffers, on every rank."""
        return full_state_dict(self.model, self.groups, self.mesh, self.stats)

    def memory(self) -> dict[str, Any]:
        """Model-state bytes on this rank: resident by role, and all of it by tier."""
        return memory(self.groups, self.stepping.optimizers, self.stepping.swapper, self.plan.offload.optimizer)


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


