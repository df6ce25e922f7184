"""Between backward and the optimizer: unscale, overflow check, clipping, and the
optimizer hooks that skip steps and refresh compute parameters afterwards.

    >>> from zerobridge.engine.step import NativeStepper
    >>> NativeStepper.__doc__.split(".")[0]
    'What happens around optimizer'

The user keeps a plain torch optimizer. Global optimizer step hooks find the
engines that own its parameters: before the step they finalise the
gradients (or hide them when the step must be skipped: fp16 overflow, or no
accumulation boundary reached); after it they push the stepped master values
into the compute parameters (and, replicated, all-gather them). With the
optimizer tier on nvme the pre-hook itself steps the engine's parameters tile
by tile (``nvme_step.py``, calling the optimizer's own step without these hooks)
and hides their gradients, so the user's ``step()`` moves only the others. So it
does, in tiles of about 1/``STEP_TILES`` of the shard, for 16-bit gradients the
optimizer takes in fp32 (``grad_store.py``): each tile's fp32 copies are cast,
stepped and dropped before the next, so no step holds a whole fp32 gradient copy.
When the optimizer's update is elementwise (AdamW, Adam, SGD: ``param_range.py``)
gradients already in ``p.grad`` (fp32 training) are stepped in the same tiles, and
a parameter larger than a tile a tile's worth of its elements at a time: the
optimizer's temporaries (torch's foreach AdamW makes one per tensor of a call, at
once) are a tile's, never the shard's or a whole matrix's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerobridge.engine import collectives
from zerobridge.engine.collectives import Pending
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.grad_store import Scale, cast_grads, cast_range, drop_grads, materialize_grads, scale_grads
from zerobridge.engine.master import push_master
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.nvme_step import StateSwapper, tiles
from zerobridge.engine.param_range import RangeStep, elementwise, ranges, splits
from zerobridge.engine.plan import EnginePlan
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.loss_scale import LossScaler
from zerobridge.runtime.step_rules import (
    Hidden,
    apply_clip,
    clip_coef,
    combine_norms,
    grad_norms,
    hide_grads,
    norm_part,
    raw_step,
)
from zerobridge.runtime.window import no_gradients
from zerobridge.spec import OffloadDevice

__all__ = ["STEP_TILES", "NativeStepper"]

STEP_TILES = 64
"""Deferred gradients (``grad_store.py``) are cast and stepped in about this many tiles of the
engine's shard, so their fp32 copies add about 1/64 of a gradient shard to the step's peak
(a parameter larger than a tile is stepped in ranges of a tile, or, for an optimizer that is
not elementwise, is a tile alone)."""

def _tiled(group: FlatGroup) -> bool:
    """``group``'s deferred gradients are cast and stepped a tile at a time: its master is not offloaded.
    An offloaded master (the spec's optimizer tier) takes its fp32 gradients whole, as on an accelerator,
    where they are cast on the host at the boundary (``grad_store.py``): a CPU run, a plan's included,
    then holds on that tier what an accelerator run holds."""
    return group.pending and group.plan.master_at.tier is OffloadDevice.NONE


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


class NativeStepper:
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
        self.scales: list[Scale] = []
        """Factors (unscale, clipping) owed by deferred gradients not cast yet, in the order applied."""
        self.tile_cap = max(1, sum(g.layout.shard_numel for g in trainable) // STEP_TILES)
        """Elements of deferred gradients cast at once by the step."""
        self.skip_repeats = False
        """Leave out the optimizer calls of a step whose memory repeats one already made: for a plan's run on
        fake tensors (``planning.fake_run``), where no value exists and only the buffers count. Every range
        of a parameter stepped in ranges allocates and frees the same buffers at its own size, so only the
        largest range is stepped (twice on a first step: its first range makes the whole-size state, which
        every later range holds beside its own new one). Once the state exists, a tile whose cast gradients
        and largest parameter are no larger than those of a tile already stepped (same dtypes) reaches no
        higher a peak and leaves nothing behind, so it is left out. Never on real tensors: their values need
        every call."""

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
        for group in self.trainable:
            if group.pending and not _tiled(group):
                materialize_grads(group)
        grads = self._grads()  # tiled ones are cast later, a tile at a time, and owe the factors
        self.scales = [1.0 / scale] if self.scaler.enabled else []
        scale_grads(grads, self.scales)
        return True

    def _cast_all(self) -> None:
        """Every deferred gradient cast now (``clip_grad_norm_`` asks for them), owed factors applied."""
        cast = []
        for group in self.trainable:
            if group.pending:
                materialize_grads(group)
                cast += [p.grad for p in group.params if p.grad is not None]
        scale_grads(cast, self.scales)
        self.scales = []

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm (every rank, every shard) is at most
        ``max_norm``; return the norm before clipping. torch's formula."""
        if not self.finalize():
            raise no_gradients()
        self._cast_all()
        grads = self._grads()
        local = norm_part(grads, norm_type, self._device())
        # Shards of one copy are summed; replicas hold the same shard and are not.
        collectives.all_reduce(local, self.mesh.reduce, self.stats,
                               op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
        return apply_clip(grads, local, max_norm, norm_type)

    def _tiles(self, group: FlatGroup, ids: set[int] | None = None) -> list[list[int]]:
        """``group``'s parameters (those in ``ids`` when given) in tiles of about ``tile_cap`` elements."""
        chosen = [i for i, p in enumerate(group.params) if ids is None or id(p) in ids]
        numels = [group.layout.pieces[i].numel for i in chosen]
        return [[chosen[k] for k in tile] for tile in tiles(numels, cap=self.tile_cap)]

    def _clip_by_tiles(self, max_norm: float) -> None:
        """The spec's clipping with deferred gradients: their norms a tile at a time (cast, measured,
        dropped), the others' as they are; the coefficient is owed by the deferred ones."""
        norms: list[torch.Tensor] = []
        for group in self.trainable:
            if not group.pending:
                norms += grad_norms([p.grad for p in group.params if p.grad is not None], 2.0)
                continue
            for tile in self._tiles(group):
                norms += grad_norms(cast_grads(group, tile, self.scales), 2.0)
                for i in tile:
                    group.params[i].grad = None
        local = combine_norms(norms, 2.0, self._device())
        collectives.all_reduce(local, self.mesh.reduce, self.stats, op=dist.ReduceOp.SUM)
        _, coef = clip_coef(local, max_norm, 2.0)
        scale_grads(self._grads(), [coef])
        self.scales.append(coef)

    def _given_tiled(self, group: FlatGroup, optimizer: torch.optim.Optimizer) -> bool:
        """``group``'s gradients, already in ``p.grad`` (fp32, or cast by ``clip_grad_norm_``), are stepped
        a tile at a time too: its master is not offloaded and the optimizer is elementwise, so one call per
        tile changes nothing (an optimizer counting its calls would count each tile)."""
        return not group.pending and group.plan.master_at.tier is OffloadDevice.NONE and elementwise(optimizer)

    def _step_by_tiles(self, optimizer: torch.optim.Optimizer) -> Hidden:
        """Step the gradients of ``optimizer``'s parameters a tile at a time, every other gradient hidden:
        deferred ones cast for the tile and dropped after it, the others (``_given_tiled``) as they are.
        Returns the gradients stepped as they are: hidden from the user's step, put back after it."""
        ids = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
        others = [(p, p.grad) for pg in optimizer.param_groups for p in pg["params"] if p.grad is not None]
        given = {id(p): g for p, g in others}
        stepped: set[int] = set()
        seen: list[tuple[object, int, int]] = []
        for param, _ in others:
            param.grad = None
        try:
            for group in self.trainable:
                if id(group) not in self.awaiting or not (group.pending or self._given_tiled(group, optimizer)):
                    continue
                stepped.update(id(p) for p in group.params)
                for tile in self._tiles(group, ids):
                    if len(tile) == 1 and splits(optimizer, group.layout.pieces[tile[0]].numel, self.tile_cap):
                        self._step_in_ranges(optimizer, group, tile[0], given.get(id(group.params[tile[0]])))
                        continue
                    if self.skip_repeats and _repeats(group, tile, optimizer, seen):
                        continue
                    if group.pending:
                        any_grad = bool(cast_grads(group, tile, self.scales))  # held by the parameters alone
                    else:
                        for i in tile:
                            group.params[i].grad = given.get(id(group.params[i]))
                        any_grad = any(group.params[i].grad is not None for i in tile)
                    if any_grad:
                        raw_step(optimizer)
                    for i in tile:
                        group.params[i].grad = None
        except BaseException:
            stepped.clear()
            raise
        finally:
            for param, grad in others:
                if id(param) not in stepped:
                    param.grad = grad
        return [(p, g) for p, g in others if id(p) in stepped]

    def _step_in_ranges(self, optimizer: torch.optim.Optimizer, group: FlatGroup, index: int,
                        given: torch.Tensor | None) -> None:
        """Step parameter ``index`` of ``group``, larger than a tile, a tile's worth of its elements at a time
        (``param_range.py``: bit-identical for elementwise optimizers); its gradient ``given``, or deferred."""
        param = group.params[index]
        if not group.handed[index] or (given is None and not group.pending):
            return
        flat = None if given is None else given.reshape(-1)
        spans = ranges(param.numel(), cap=self.tile_cap)
        with RangeStep(optimizer, param) as stepping:
            if self.skip_repeats and len(spans) > 1:
                largest = max(spans, key=lambda span: span[1] - span[0])
                # a first step makes the whole-size state at its first range and holds it through the others
                spans = [largest, largest] if stepping.fresh else [largest]
            for start, stop in spans:
                with stepping.narrowed(start, stop):
                    if flat is None:
                        cast_range(group, index, start, stop, self.scales)
                    else:
                        param.grad = flat[start:stop]
                    raw_step(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> Stash:
        """Optimizer pre-step hook: skip (hide gradients), let the step run, or run it here tile
        by tile: for deferred 16-bit gradients (``_step_by_tiles``; the user's step then moves the
        others), or when the optimizer state is on nvme."""
        self.optimizers.add(optimizer)
        depth = self.depth.get(id(optimizer), 0)
        self.depth[id(optimizer)] = depth + 1
        if depth:
            return Stash(stepping=False, nested=True)
        if not self.finalize() or self.skip:
            return Stash(stepping=False, hidden=hide_grads(optimizer, self.param_ids))
        deferred = self.swapper is None and any(g.pending for g in self.trainable)
        if self.plan.clip_grad_norm is not None:  # the spec's clipping, at step time as DeepSpeed does
            if deferred:
                self._clip_by_tiles(self.plan.clip_grad_norm)
            else:
                self.clip_grad_norm(self.plan.clip_grad_norm)
        if self.swapper is None:
            if any(g.pending or self._given_tiled(g, optimizer) for g in self.trainable):
                return Stash(stepping=True, hidden=self._step_by_tiles(optimizer))
            return Stash(stepping=True)
        self._cast_all()
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


def _repeats(group: FlatGroup, tile: list[int], optimizer: torch.optim.Optimizer,
             seen: list[tuple[object, int, int]]) -> bool:
    """Stepping ``tile`` of ``group`` would repeat the memory of a tile in ``seen`` (``skip_repeats``): the
    state exists, and it casts no more gradient elements, steps no larger a parameter, in the same dtypes.
    Otherwise it is added to ``seen``."""
    if not all(optimizer.state.get(group.params[i]) for i in tile):
        return False
    handed = [group.layout.pieces[i].numel for i in tile if group.handed[i]]
    kinds = (group.pending, group.plan.accumulate_dtype, group.plan.master_dtype, group.master_device)
    cast, largest = sum(handed), max(handed, default=0)
    if any(k == kinds and c >= cast and m >= largest for k, c, m in seen):
        return True
    seen.append((kinds, cast, largest))
    return False

