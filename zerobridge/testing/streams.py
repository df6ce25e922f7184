"""A stream backend that records what CUDA streams would run, for tests on a CPU.

    >>> import torch
    >>> from zerobridge.engine.streams import Streams
    >>> with recording() as log:
    ...     streams = Streams(torch.device("cpu"))
    ...     with streams.on("gather"):
    ...         mark = streams.mark("gather")
    ...     streams.use(mark, torch.ones(1))
    >>> [entry[0] for entry in log]
    ['record', 'wait_event', 'record_stream']
    >>> log[0][1], log[1][1]
    ('gather', 'compute')

``recording()`` makes every engine built inside it see a device with side
streams (``Streams.overlaps`` is true, so it prefetches the next unit in
forward and issues collectives in order on their streams), while the work still
runs in program order on the CPU, so the numbers are unchanged. The log holds,
in order:

- ``("record", stream, event)``, ``("wait_event", waiter, event)``,
  ``("wait_stream", waiter, stream)``, ``("record_stream", stream, ptr)``;
- ``(kind, stream, ptr, group_size, async_op, id)`` for each collective the
  engine issues (``all_gather``, ``reduce_scatter``, ``all_reduce``), ``ptr``
  being the storage of its output, and ``("wait", id)`` for each wait on one in
  flight (``logging_collectives``, also usable without the stream backend);
- whatever the test appends itself (``("compute", name, ptr)`` from a forward
  pre-hook, say).

The compute stream is ``"compute"``; side streams are named by their role.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import zerobridge
from zerobridge.engine import collectives, streams
from zerobridge.testing.parity import ParityNet, batch, make_optimizer

__all__ = ["RecordingBackend", "logging_collectives", "recording", "run_recorded", "storage_ptr"]


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (0 while it has none)."""
    return tensor.untyped_storage().data_ptr() if tensor.untyped_storage().nbytes() else 0


class RecordingBackend:
    """``streams.StreamBackend`` whose streams are names and whose calls are logged."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.stack = ["compute"]
        self.ids = itertools.count()

    def current(self) -> str:
        return self.stack[-1]

    def new_stream(self, role: str) -> str:
        return role

    @contextmanager
    def enter(self, stream: str) -> Iterator[None]:
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def wait_stream(self, waiter: str, stream: str) -> None:
        self.log.append(("wait_stream", waiter, stream))

    def record_event(self, stream: str) -> int:
        event = next(self.ids)
        self.log.append(("record", stream, event))
        return event

    def wait_event(self, waiter: str, event: int) -> None:
        self.log.append(("wait_event", waiter, event))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", stream, storage_ptr(tensor)))


class _Logged:
    """A collective in flight whose ``wait`` is logged as ``("wait", id)``."""

    def __init__(self, work: Any, ident: int, log: list[tuple[Any, ...]]) -> None:
        self.work, self.ident, self.log = work, ident, log

    def wait(self) -> object:
        self.log.append(("wait", self.ident))
        return self.work.wait()


@contextmanager
def logging_collectives(log: list[tuple[Any, ...]], current: Callable[[], str] = lambda: "compute",
                        ) -> Iterator[list[tuple[Any, ...]]]:
    """Log each collective the engine issues as ``(kind, stream, ptr, group_size, async_op, id)``
    (``current()`` names the stream) and each wait on one in flight as ``("wait", id)``."""
    saved = {name: getattr(collectives, name) for name in ("all_gather", "reduce_scatter", "all_reduce")}
    ids = itertools.count()

    def logged(kind: str, issue: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = args[2 if kind != "all_reduce" else 1]
            size = 1 if group is None else dist.get_world_size(group)
            ident = next(ids)
            log.append((kind, current(), storage_ptr(args[0]), size, kwargs.get("async_op", False), ident))
            work = issue(*args, **kwargs)
            return _Logged(work, ident, log) if kwargs.get("async_op", False) else work
        return call
    for name, issue in saved.items():
        setattr(collectives, name, logged(name, issue))
    try:
        yield log
    finally:
        for name, issue in saved.items():
            setattr(collectives, name, issue)


@contextmanager
def recording() -> Iterator[list[tuple[Any, ...]]]:
    """Engines built inside run on a recording stream backend; yields the log."""
    log: list[tuple[Any, ...]] = []
    backend = RecordingBackend(log)
    saved_backend = streams.stream_backend
    streams.stream_backend = lambda device: backend
    try:
        with logging_collectives(log, backend.current):
            yield log
    finally:
        streams.stream_backend = saved_backend


def run_recorded(spec: Any, *, steps: int = 3, record: bool = True) -> dict[str, Any]:
    """On every rank: ``ParityNet`` trained ``steps`` steps under ``spec`` (a ``StrategySpec``),
    on the recording backend unless ``record`` is false. Returns the log, with
    ``("compute", unit, ptr)`` before each unit's forward (``ptr``: the storage its first
    parameter view reads), ``("step", k)`` before each step and ``("optimizer",)`` before
    each optimizer step, and the losses."""

    rank, world = dist.get_rank(), dist.get_world_size()
    log: list[tuple[Any, ...]] = []
    with recording() if record else logging_collectives(log) as recorded:
        log = recorded
        model = zerobridge.prepare(ParityNet(0), config=spec)
        engine = model.zerobridge_engine
        for unit in engine.units:
            slot = next((g.refs[0].slots[0] for g in unit.groups if g.refs), None)
            if slot is not None:
                def hook(module: torch.nn.Module, args: Any, index: int = unit.index, at: Any = slot) -> None:
                    owner, attr = at
                    log.append(("compute", index, storage_ptr(owner._parameters[attr])))
                unit.module.register_forward_pre_hook(hook)
        opt = make_optimizer(list(model.named_parameters()), "adamw")
        losses = []
        for step in range(steps):
            log.append(("step", step))
            tokens, targets = batch(step, 0, 8)
            per_rank = 8 // world
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = model(tokens[mine], targets[mine])
            loss.backward()
            log.append(("optimizer",))
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    return {"log": log, "losses": losses,
            "groups": {"gather": _ranks(engine.mesh.gather), "replicate": _ranks(engine.mesh.replicate)}}


def _ranks(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)
