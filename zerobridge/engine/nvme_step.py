"""The nvme optimizer tier: optimizer state (and master values kept in files)
streamed through the step one tile at a time.

    >>> from zerobridge.engine.nvme_step import tiles
    >>> tiles([5, 3, 12, 2, 2], cap=8)      # elements of each parameter's run
    [[0, 1], [2], [3, 4]]

Between steps the state tensors of the engine's sharded parameters
(``optimizer.state[p]``) are in a swap file and ``optimizer.state`` has no
entry for them; so are the master values when they are a separate copy (the
parameters then hold placeholders). At step time the parameters are taken in
tiles of at most ``offload.sub_group_size`` elements: read the tile's master
values and state, run the user's optimizer on those parameters only (every
other parameter's gradient hidden), push the new values into the compute
parameters, write master and state back and let them go. State tensors of one
element (AdamW's ``step``) stay in memory. With ``pipeline_read`` the next
tile is read while this one steps; with ``pipeline_write`` a tile is written
while the next one steps (at most three tiles in memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.master import push_run
from zerobridge.engine.swapfile import FileRegion, SwapSpace
from zerobridge.engine.tiers import OffloadPlan

__all__ = ["StateSwapper", "tiles"]

Member = tuple[FlatGroup, int]
Write = tuple[FileRegion, int, torch.Tensor]


def tiles(numels: list[int], *, cap: int) -> list[list[int]]:
    """Consecutive indices whose elements add up to at most ``cap``; one larger
    than ``cap`` is a tile alone."""
    out: list[list[int]] = []
    filled = 0
    for index, numel in enumerate(numels):
        if not out or filled + numel > cap:
            out.append([])
            filled = 0
        out[-1].append(index)
        filled += numel
    return out


@dataclass(frozen=True)
class Stored:
    """A state tensor kept in a swap file."""

    region: FileRegion
    shape: torch.Size
    device: torch.device


@dataclass
class Loaded:
    """A tile member read into memory."""

    group: FlatGroup
    index: int
    master: torch.Tensor | None
    state: dict[str, Any] | None



def _held(optimizer: torch.optim.Optimizer, item: Loaded) -> int:
    """Bytes of a tile member's master and state in memory during its step."""
    tensors = [item.master, *optimizer.state.get(item.group.params[item.index], {}).values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class StateSwapper:
    """Keeps the optimizer state of ``groups`` (and their master files) on nvme and
    steps it tile by tile."""

    def __init__(self, groups: list[FlatGroup], space: SwapSpace, plan: OffloadPlan) -> None:
        members = [(g, i) for g in groups for i in range(len(g.params))]
        numels = [g.layout.pieces[i].numel for g, i in members]
        self.tiles: list[list[Member]] = [[members[k] for k in tile]
                                          for tile in tiles(numels, cap=plan.sub_group_size)]
        self.owner = {id(g.params[i]): (g, i) for g, i in members}
        self.space = space
        self.pipeline_read = plan.pipeline_read
        self.pipeline_write = plan.pipeline_write
        self.slots: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[nn.Parameter, dict[str, Any]]] = \
            weakref.WeakKeyDictionary()
        """Per optimizer and parameter, each state entry: a ``Stored`` or the value itself."""
        self.peak_bytes = 0
        """Most master and state bytes of one tile in memory during the last step
        (with pipelining, up to three tiles are)."""

    # ------------------------------------------------------------------ the step

    def step(self, optimizer: torch.optim.Optimizer, grads: dict[int, torch.Tensor | None],
             raw_step: Callable[[torch.optim.Optimizer], None]) -> None:
        """Step every engine parameter of ``optimizer`` whose gradient (``grads``, by
        ``id``) is not ``None``, tile by tile; ``raw_step`` runs the optimizer itself."""
        store = self.slots.setdefault(optimizer, {})
        work = [[(g, i) for g, i in tile if grads.get(id(g.params[i])) is not None] for tile in self.tiles]
        work = [tile for tile in work if tile]
        others = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for p, _ in others:
            p.grad = None
        self.peak_bytes = 0
        pool = ThreadPoolExecutor(1, thread_name_prefix="zerobridge-swap") \
            if self.pipeline_read or self.pipeline_write else None
        try:
            ahead: Future[list[Loaded]] | None = None
            writing: Future[None] | None = None
            for k, tile in enumerate(work):
                loaded = ahead.result() if ahead is not None else self._load(store, tile)
                ahead = None
                if pool is not None and self.pipeline_read and k + 1 < len(work):  # read the next tile meanwhile
                    ahead = pool.submit(self._load, store, work[k + 1])
                writes = self._step_tile(optimizer, store, loaded, grads, raw_step)
                del loaded  # nothing of this tile but its pending writes stays in memory
                if writing is not None:
                    writing.result()
                writing = self._submit(pool if self.pipeline_write else None, _write_all, writes)
                del writes
            if writing is not None:
                writing.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            for p, grad in others:
                p.grad = grad

    def _step_tile(self, optimizer: torch.optim.Optimizer, store: dict[nn.Parameter, dict[str, Any]],
                   loaded: list[Loaded], grads: dict[int, torch.Tensor | None],
                   raw_step: Callable[[torch.optim.Optimizer], None]) -> list[Write]:
        for item in loaded:
            self._install(optimizer, item, grads)
        raw_step(optimizer)
        self.peak_bytes = max(self.peak_bytes, sum(_held(optimizer, item) for item in loaded))
        return [w for item in loaded for w in self._take(optimizer, store, item)]

    @staticmethod
    def _submit(pool: ThreadPoolExecutor | None, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if pool is not None:
            return pool.submit(fn, *args)
        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done

    def _load(self, store: dict[nn.Parameter, dict[str, Any]], tile: list[Member]) -> list[Loaded]:
        out = []
        for group, i in tile:
            master = None
            if group.master_file is not None:
                piece = group.layout.pieces[i]
                master = group.master_file.read(piece.shard_start, torch.empty(piece.numel,
                                                                                dtype=group.plan.master_dtype))
            slots = store.get(group.params[i])
            out.append(Loaded(group, i, master, None if slots is None else _read_slots(slots)))
        return out

    @staticmethod
    def _install(optimizer: torch.optim.Optimizer, item: Loaded, grads: dict[int, torch.Tensor | None]) -> None:
        param = item.group.params[item.index]
        if item.master is not None:
            param.data = item.master.to(item.group.master_device).view(param.shape)
        if item.state is not None and not optimizer.state.get(param):  # state put there by hand wins
            optimizer.state[param] = item.state
        grad = grads[id(param)]
        assert grad is not None
        param.grad = grad if grad.device == param.device else grad.to(param.device)

    def _take(self, optimizer: torch.optim.Optimizer, store: dict[nn.Parameter, dict[str, Any]],
              item: Loaded) -> list[Write]:
        """After the tile's step: push values to compute, queue writes, let go."""
        group, i = item.group, item.index
        param = group.params[i]
        param.grad = None
        values = param.detach().reshape(-1)
        push_run(group, i, values)
        writes: list[Write] = []
        if group.master_file is not None:
            writes.append((group.master_file, group.layout.pieces[i].shard_start, values))
            param.data = group.placeholder(i)
        state = optimizer.state.pop(param, None)
        if state:
            writes += self._keep(store, param, state)
        return writes

    def _keep(self, store: dict[nn.Parameter, dict[str, Any]], param: nn.Parameter,
              state: dict[str, Any]) -> list[Write]:
        """Record ``state`` for ``param``: tensors of more than one element go to the file."""
        old = store.get(param, {})
        slots: dict[str, Any] = {}
        writes: list[Write] = []
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                stored = old.get(key)
                region = stored.region if isinstance(stored, Stored) else None
                if region is None or region.numel != value.numel() or region.dtype != value.dtype:
                    region = self.space.allocate(value.numel(), value.dtype)
                slots[key] = Stored(region, value.shape, value.device)
                writes.append((region, 0, value))
            else:
                slots[key] = value
        for key, slot in old.items():
            if isinstance(slot, Stored) and not (isinstance(slots.get(key), Stored)
                                                 and slots[key].region is slot.region):
                self.space.release(slot.region)
        store[param] = slots
        return writes

    # ------------------------------------------------------------------ access and accounting

    def read_state(self, optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, Any]:
        """``param``'s state in memory (read from the file; empty before any)."""
        slots = self.slots.get(optimizer, {}).get(param)
        if slots is None:
            return dict(optimizer.state.get(param, {}))
        return _read_slots(slots)

    def write_state(self, optimizer: torch.optim.Optimizer, param: nn.Parameter, state: dict[str, Any]) -> None:
        """Replace ``param``'s state: the next step continues from it."""
        optimizer.state.pop(param, None)
        group, _ = self.owner[id(param)]
        state = {k: v.to(group.master_device) if isinstance(v, torch.Tensor) and v.numel() > 1 else v
                 for k, v in state.items()}
        _write_all(self._keep(self.slots.setdefault(optimizer, {}), param, state))

    def file_bytes(self) -> int:
        """Bytes of optimizer state in the swap file."""
        return sum(slot.region.nbytes for store in self.slots.values() for slots in store.values()
                   for slot in slots.values() if isinstance(slot, Stored))

    def resident_bytes(self) -> int:
        """Bytes of the small state tensors kept in memory."""
        return sum(v.numel() * v.element_size() for store in self.slots.values() for slots in store.values()
                   for v in slots.values() if isinstance(v, torch.Tensor))


def _read_slots(slots: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, slot in slots.items():
        if isinstance(slot, Stored):
            value = slot.region.read(0, torch.empty(slot.shape, dtype=slot.region.dtype))
            out[key] = value if slot.device.type == "cpu" else value.to(slot.device)
        else:
            out[key] = slot
    return out


def _write_all(writes: list[Write]) -> None:
    for region, start, values in writes:
        region.write(start, values)
