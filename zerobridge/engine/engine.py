"""The engine: hooks that run any partitioning plan on an unchanged model.

    >>> import torch, zerobridge
    >>> model = zerobridge.prepare(torch.nn.Linear(4, 2), stage=2)   # world size 1 without a launcher
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> [p.grad.shape for p in model.parameters()]
    [torch.Size([2, 4]), torch.Size([2])]

Calls go one way: the hooks here drive units (``schedule.py`` gathers them,
``reducing.py`` reduces their buckets), units drive flat groups
(``flat_group.py``), flat groups issue collectives (``collectives.py``). On
CUDA the gathers and reductions run on side streams (``streams.py``).

[Note: life of a step]
forward  root pre-hook: cast inputs, show the replicated groups' views (each
         bucket cut again at its first module: ``bucket_views.py``).
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
         state tile by tile from nvme, ``nvme_step.py``); after the step push master
         values into the compute parameters.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerobridge.engine import collectives
from zerobridge.engine.bucket_views import ReplicatedViews, hide, show
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.grad_store import attach_grads
from zerobridge.engine.grouping import build_groups
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.nvme_step import StateSwapper
from zerobridge.engine.plan import EnginePlan
from zerobridge.engine.reducing import ReductionQueue
from zerobridge.engine.schedule import Order, Residency, Unit
from zerobridge.engine.state import memory
from zerobridge.engine.step import NativeStepper
from zerobridge.engine.streams import Streams
from zerobridge.engine.tiers import open_spaces
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.loss_scale import ScaleGrad
from zerobridge.runtime.step_rules import install_optimizer_hooks, nonfinite_flag
from zerobridge.runtime.tensors import host_flags
from zerobridge.runtime.unit_wrap import after_inputs_backward, cast_floats, checkpointed
from zerobridge.runtime.window import AccumulationWindow
from zerobridge.runtime.wrap_units import collect_params, owners, unit_modules
from zerobridge.spec import BackwardPrefetch, GradSync, ParamSharding

__all__ = ["Engine", "Unit"]


class Engine:
    """Runs one ``EnginePlan`` on one model. Built by ``zerobridge.prepare``."""

    # ------------------------------------------------------------------ initialization

    def __init__(self, model: nn.Module, plan: EnginePlan, mesh: Mesh, device: torch.device | None = None) -> None:
        """``device``: where a meta-device model's groups go (values: ``backends/native/materialize.py``)."""
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.device = device or next(model.parameters()).device
        self.stats = CommStats()
        self._agree_on_values()
        self._cut_units()
        self.stepper = NativeStepper(plan, mesh, self.stats, self.trainable, self._swapper())
        self.streams = Streams(self.device)
        self.reductions = ReductionQueue(self._reduction_order(), self.streams)
        # Side streams let the next unit's gather run beside this one's compute: prefetch it.
        self.forward_prefetch = plan.forward_prefetch or self.streams.overlaps
        self._register_hooks()
        # Runtime state.
        self.window = AccumulationWindow(plan.accumulation_steps, plan.grad_sync)
        self.residency = Residency(self.groups, self.streams)
        self.forward_order: list[Unit] = []
        self.seen: set[Unit] = set()
        self.previous: Order[Unit] = Order([])
        self.backward_order: Order[Unit] = Order([])
        self.stats.reset()
        install_optimizer_hooks(self.stepper)

    def _agree_on_values(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, buffers in the plan's dtype."""
        collectives.broadcast_module(self.model, 0, self.mesh.control, self.stats)
        if self.plan.buffer_dtype is not None:
            for module in self.model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        module._buffers[name] = buf.to(self.plan.buffer_dtype)

    def _cut_units(self) -> None:
        """Cut the model into units and build each unit's flat groups (and the replicated groups)."""
        refs = collect_params(self.model)
        modules = unit_modules(self.model, self.plan.wrap)
        owner = owners(self.model, modules, refs)
        self.units = [Unit(i, m) for i, m in enumerate(modules)]
        self.spaces = open_spaces(self.plan.offload, rank=self.mesh.rank)
        per_unit, self.replicated = build_groups(refs, owner, len(self.units), self.plan, self.mesh, self.stats,
                                                 self.spaces, self.device)
        for unit, groups in zip(self.units, per_unit):
            unit.groups = groups
        self.groups = [g for u in self.units for g in u.groups] + self.replicated
        self.unit_of = {id(g): u for u in self.units for g in u.groups}
        self.trainable = [g for g in self.groups if g.plan.trainable]
        self.views = ReplicatedViews(self.replicated, modules, self.plan.spec.compile)

    def _swapper(self) -> StateSwapper | None:
        """The streamed step of the nvme optimizer tier, when the spec asks for it."""
        if self.spaces.optimizer is None:
            return None
        return StateSwapper(self.trainable, self.spaces.optimizer, self.plan.offload)

    def _reduction_order(self) -> list[tuple[FlatGroup, int]]:
        """The order every rank reduces buckets in: buckets whose earliest-registered parameter
        comes last are expected to finish first in backward."""
        order = [(g, b.index, min(g.refs[i].order for i in b.params)) for g in self.trainable
                 for b in g.layout.buckets]
        return [(g, b) for g, b, _ in sorted(order, key=lambda item: -item[2])]

    def _register_hooks(self) -> None:
        """Gradient hooks on every trainable bucket, forward hooks on every unit, and activation
        checkpointing where the spec asks."""
        for group in self.groups:
            hide(group)
            for b, leaf in enumerate(group.leaves):
                if group.plan.trainable:
                    leaf.register_post_accumulate_grad_hook(self._bucket_hook(group, b))
        self._install_hooks()

    def _install_hooks(self) -> None:
        for unit in self.units:
            pre, post = (torch.compiler.disable(h(unit)) for h in (self._pre_forward_hook, self._post_forward_hook))
            unit.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
            unit.module.register_forward_hook(post, with_kwargs=True)
        if self.plan.activation_checkpointing:
            targets = [u.module for u in self.units[1:]] or [self.model]
            for module in targets:
                module.forward = checkpointed(module.forward)

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
        if unit.index == 0 and not self.window.in_backward:
            args, kwargs = self._root_pre_forward(args, kwargs, grad=grad)
        first = not self.window.in_backward and unit not in self.seen  # its first call in this forward
        if first:
            self.forward_order.append(unit)
            self.seen.add(unit)
        self.residency.gather(unit, backward=False)
        if self.forward_prefetch and not self.window.in_backward:
            self._prefetch(unit, self.previous, backward=False)
        self.residency.wait(unit)
        for group in unit.groups:
            show(group, mark_used=grad and not self.window.in_backward)
        if grad and first and unit.frozen and self.plan.sharding.sharded_at_rest:
            # On the first call only: its inputs' gradients come last when a unit runs twice.
            args, kwargs = after_inputs_backward((args, kwargs), self._post_backward_hook(unit))
        return args, kwargs

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        if self.window.in_backward:  # recomputation under activation checkpointing
            return output
        grad = torch.is_grad_enabled()
        for group in unit.groups:
            hide(group)
        if not grad or (self.plan.sharding is ParamSharding.RESHARD_AFTER_FORWARD and not self._reused(unit)):
            self.residency.free(unit, unit.groups, keep_secondary=grad)
        if unit.index == 0:
            output = self._root_post_forward(output, grad=grad)
        if grad:
            hook = self._pre_backward_hook(unit)
            for tensor in pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        return output

    def _root_pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, grad: bool
                          ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A forward pass begins (the root unit, outside a backward recomputation): remember the
        last pass's unit order for prefetching, start a stream pass, cast the inputs to the compute
        dtype and show the replicated groups' views."""
        if self.forward_order:
            self.previous = Order(self.forward_order, {u: u.numel for u in self.forward_order})
        self.forward_order, self.seen = [], set()
        self.streams.begin_pass()
        if self.plan.compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), self.plan.compute_dtype)
        self.views.begin(grad)
        return args, kwargs

    def _root_post_forward(self, output: Any, *, grad: bool) -> Any:
        """The forward pass ends: hide the replicated groups' views and scale the outputs' gradients
        by the loss scale (fp16)."""
        self.views.end()
        if grad and self.stepper.scaler.enabled:
            output = pytree.tree_map(lambda t: ScaleGrad.apply(t, self.stepper.scaler.scale)
                                     if isinstance(t, torch.Tensor) and t.requires_grad else t, output)
        return output

    def _reused(self, unit: Unit) -> bool:
        """Keep a unit gathered after forward when its backward use comes within
        ``max_reuse_distance`` gathered elements (the last units of forward)."""
        limit = self.plan.max_reuse_distance
        if not limit or self.previous.position(unit) is None:
            return False
        return 2 * self.previous.numel_after(unit) <= limit

    def _prefetch(self, unit: Unit, order: Order[Unit], *, backward: bool) -> None:
        """Gather the units after ``unit`` in ``order`` within the prefetch bucket (one unit when it is
        unset), the live-parameter cap and the in-flight cap. Units already gathered count against the
        bucket; the scan resumes where the last one stopped (``order.frontier``), so a pass over the
        order looks at each unit once."""
        budget = self.plan.prefetch_bucket
        at = order.position(unit)
        if budget == 0 or at is None:  # DeepSpeed: a prefetch bucket of 0 turns prefetching off
            return
        live_cap, inflight_cap = self.plan.max_live_parameters, self.plan.max_inflight_gathers
        start = max(at + 1, order.frontier)
        ahead = order.numel_between(at + 1, start)
        for k in range(start, len(order.items)):
            nxt = order.items[k]
            numel = nxt.numel
            if ahead and (budget is None or ahead + numel > budget):
                break
            if self.residency.is_sharded(nxt):
                if live_cap is not None and self.residency.live + numel > live_cap:
                    break
                if inflight_cap is not None and len(self.residency.inflight) >= inflight_cap:
                    break
                self.residency.gather(nxt, backward=backward)
            ahead += numel
            order.frontier = k + 1

    # ------------------------------------------------------------------ backward

    def _pre_backward_hook(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(unit)
        return hook

    def _begin_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.window.begin():  # a new window: the accumulators start from zero
            single_reduce = self.plan.grad_sync is GradSync.ACCUMULATION_BOUNDARY or self.plan.accumulation_steps == 1
            for group in self.trainable:
                group.begin_window(single_reduce=single_reduce)
        self.streams.begin_pass()
        self.reductions.restart()
        self.backward_order = Order(self.forward_order[::-1], {u: u.numel for u in self.forward_order})

    def _pre_backward(self, unit: Unit) -> None:
        if not self.window.in_backward:
            self._begin_backward()
        if unit.backward_ready:
            return
        unit.backward_ready = True
        with torch.enable_grad():  # views for recomputation must match the original forward
            if unit.index == 0:
                for group in self.replicated:
                    show(group, mark_used=False)
            self.residency.gather(unit, backward=True)
            if self.plan.backward_prefetch is BackwardPrefetch.BEFORE_GRAD:
                self._prefetch(unit, self.backward_order, backward=True)
            self.residency.wait(unit)
            for group in unit.groups:
                show(group, mark_used=False)

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
        if not self.window.in_backward:
            self._begin_backward()
        if self.window.reduces:
            self.reductions.arrived(group, b)
            if self.plan.overlap_reduce:
                self.reductions.launch(self.plan.gradient_divisor)
        else:
            group.accumulate_local(b)
        unit = self.unit_of.get(id(group))
        if unit is None:
            return
        unit.fired += 1
        if unit.fired == unit.trainable_buckets and self.plan.sharding.sharded_at_rest:
            self._release(unit, [g for g in unit.groups if g.plan.trainable])

    def _post_backward_hook(self, unit: Unit) -> Any:
        engine = weakref.ref(self)

        def hook() -> None:
            alive = engine()
            if alive is not None:
                alive._inputs_backward_done(unit)
        return hook

    def _inputs_backward_done(self, unit: Unit) -> None:
        """The gradients of ``unit``'s inputs are computed: its frozen groups are not needed
        again this backward (once its trainable buckets fired too)."""
        unit.inputs_done = True
        if unit.fired == unit.trainable_buckets:
            self._release(unit, [])

    def _release(self, unit: Unit, groups: list[FlatGroup]) -> None:
        """Free ``groups`` after their backward; the unit's frozen groups too once the gradients
        of its inputs are computed (FSDP2's post-backward: frozen parameters never reduce, so
        nothing else says when they are done)."""
        if unit.inputs_done and unit.fired == unit.trainable_buckets:
            groups = groups + unit.frozen
        for group in groups:
            hide(group)
        self.residency.free(unit, groups, keep_secondary=False)
        if self.plan.backward_prefetch is BackwardPrefetch.AFTER_GRAD:
            self._prefetch(unit, self.backward_order, backward=True)

    def _end_of_backward(self) -> None:
        if self.window.reduces:
            self.reductions.launch(self.plan.gradient_divisor, flush=True)
        self.reductions.land_all()
        for unit in self.units:
            for group in unit.groups:
                hide(group)
            self.residency.free(unit, unit.groups, keep_secondary=False)
            unit.backward_ready = False
            unit.fired = 0
            unit.inputs_done = False
        for group in self.replicated:
            hide(group)
        if self.window.end():
            self._close_window()

    def _close_window(self) -> None:
        """Agree on the used parameters (and any overflow, when steps may be skipped):
        one all-reduce, one host read."""
        device = self.groups[0].full.device
        used = [float(u) for g in self.trainable for u in g.used]
        parts = [torch.tensor(used, dtype=torch.float32, device=device)] if used else []
        if self.stepper.checks_nonfinite:
            parts.append(nonfinite_flag([g.grad_store for g in self.trainable if g.grad_store is not None], device))
        flags = torch.cat(parts) if parts else torch.zeros(0, device=device)
        collectives.all_reduce(flags, self.mesh.control, self.stats, op=torch.distributed.ReduceOp.MAX)
        host = host_flags(flags, nonfinite_last=self.stepper.checks_nonfinite)  # the step's one host read
        start = 0
        for group in self.trainable:
            count = len(group.refs)
            attach_grads(group, host[start:start + count])
            group.end_window()
            start += count
        self.stepper.gradients_ready(found_nonfinite=self.stepper.checks_nonfinite and host[-1] > 0)

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate gradients locally; the next backward outside reduces them all."""
        return self.window.no_sync()

    # ------------------------------------------------------------------ step and state

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks; return that norm."""
        return self.stepper.clip_grad_norm(max_norm, norm_type)

    def memory(self) -> dict[str, Any]:
        """Model-state bytes on this rank: resident by role, and all of it by tier."""
        return memory(self.groups, self.stepper.optimizers, self.stepper.swapper, self.plan.offload.optimizer)
