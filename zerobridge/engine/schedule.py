"""Wrap units, the order they run in, and what is gathered: kept as the step goes.

    >>> from zerobridge.engine.schedule import Order
    >>> order = Order(["root", "a", "b", "c"], sizes={"root": 1, "a": 10, "b": 20, "c": 30})
    >>> order.position("a"), order.numel_after("a"), order.numel_between(2, 4)
    (1, 50, 50)
    >>> order.numel_after("c"), order.position("x")
    (0, None)

The engine asks, at every unit's forward and backward, which units come next
(prefetch) and how many elements come after a unit (reuse distance), and it
checks the live and in-flight budgets. Each answer here costs time in the
number of units it returns, never in the number of units in the model: the
orders carry a position index and suffix sums built once per step, and the
gathered elements and in-flight gathers are counters updated at each gather
and free, so a step's bookkeeping is linear in the number of units (a model
cut into hundreds of per-module units, as DeepSpeed configs are, steps in time
proportional to its units).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from torch import nn

from zerobridge.engine.flat_group import FlatGroup, GatherState
from zerobridge.engine.streams import Streams

__all__ = ["Order", "Residency", "Unit"]

T = TypeVar("T", bound=Hashable)


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
    inputs_done: bool = False
    """The gradients of its forward inputs were computed: its backward is over (``PostBackward``)."""

    def __hash__(self) -> int:
        return self.index

    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    @property
    def trainable_buckets(self) -> int:
        return sum(len(g.layout.buckets) for g in self.groups if g.plan.trainable)

    @property
    def frozen(self) -> list[FlatGroup]:
        return [g for g in self.groups if not g.plan.trainable]


class Order(Generic[T]):
    """A sequence of units with positions, suffix sums of their sizes, and how far
    prefetching has looked (``frontier``: positions before it were looked at in this pass)."""

    def __init__(self, items: Sequence[T], sizes: dict[T, int] | None = None) -> None:
        self.items = list(items)
        self.frontier = 0
        self._at = {item: i for i, item in enumerate(self.items)}
        self._suffix = [0] * (len(self.items) + 1)  # summed sizes of the items from position i on
        for i in range(len(self.items) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + (sizes[self.items[i]] if sizes else 0)

    def position(self, item: T) -> int | None:
        return self._at.get(item)

    def numel_between(self, start: int, stop: int) -> int:
        """Summed sizes of the items at positions ``start`` to ``stop - 1``."""
        return self._suffix[start] - self._suffix[max(start, stop)]

    def numel_after(self, item: T) -> int:
        """Summed sizes of the items after ``item`` (0 when it is not in the order)."""
        at = self._at.get(item)
        return 0 if at is None else self._suffix[at + 1]


class Residency:
    """Elements gathered beyond the shards, and units with a gather in flight, as counters.

    Every gather, wait and free of a unit's groups goes through here, so the two
    budgets of prefetching (``max_live_parameters``, ``max_inflight_gathers``) are
    read in constant time."""

    def __init__(self, groups: Sequence[FlatGroup], streams: Streams) -> None:
        self.live = sum(g.gathered_numel for g in groups)
        self.inflight: set[int] = set()
        self.streams = streams
        self.marks: dict[int, Any] = {}
        """Per unit in flight: the gather stream's event after its copy-in and all-gather."""

    def gather(self, unit: Unit, *, backward: bool) -> None:
        """Issue the all-gathers of ``unit`` that are not there or on their way (on the
        gather stream; its buffers are handed to the compute stream by ``wait``)."""
        before = sum(g.gathered_numel for g in unit.groups)
        issued = False
        with self.streams.on("gather"):
            for group in unit.groups:
                if group.state is GatherState.SHARDED:
                    issued = True
                    if backward:
                        self.streams.lend("gather", group.secondary)
                    group.unshard(backward=backward, async_op=not self.streams.overlaps)
            if issued and self.streams.overlaps:  # without streams there is nothing to wait for
                self.marks[unit.index] = self.streams.mark("gather")
        if any(g.state is GatherState.GATHERING for g in unit.groups):
            self.inflight.add(unit.index)
        self.live += sum(g.gathered_numel for g in unit.groups) - before

    def wait(self, unit: Unit) -> None:
        """The compute stream may use ``unit``'s gathered parameters from here on."""
        for group in unit.groups:
            group.wait_unshard()
        if unit.index in self.marks:
            self.streams.use(self.marks.pop(unit.index), *(g.full for g in unit.groups if g.gathered_numel))
        self.inflight.discard(unit.index)

    def free(self, unit: Unit, groups: Sequence[FlatGroup], *, keep_secondary: bool) -> None:
        """Free ``groups`` (of ``unit``) back to their shards."""
        before = sum(g.gathered_numel for g in groups)
        for group in groups:
            group.reshard(keep_secondary=keep_secondary)
        self.live -= before - sum(g.gathered_numel for g in groups)
        if all(g.state is not GatherState.GATHERING for g in unit.groups):
            self.inflight.discard(unit.index)
            self.marks.pop(unit.index, None)

    def is_sharded(self, unit: Unit) -> bool:
        return all(g.state is GatherState.SHARDED for g in unit.groups)
