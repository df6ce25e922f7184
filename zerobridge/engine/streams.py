"""Side streams for gathers and reductions, and the events that order them.

    >>> import torch
    >>> from zerobridge.engine.streams import Streams
    >>> streams = Streams(torch.device("cpu"))     # no streams on a CPU: every call is a no-op
    >>> streams.overlaps
    False
    >>> with streams.on("gather"):
    ...     mark = streams.mark("gather")
    >>> streams.use(mark, torch.ones(2))

On CUDA, as FSDP2 does, an engine runs three side streams beside the compute
(current) stream:

- ``gather``: a unit's copy-in (the shard read from host memory, the cast of an
  fp32 shard to the compute dtype) and its all-gather. The gathered buffer is
  allocated there and handed to the compute stream by ``use``: the compute
  stream waits for the gather's event, and the buffer is recorded as used by
  the compute stream, so freeing it after the unit (on the CPU, long before the
  GPU is done) never lets the next gather overwrite it early.
- ``reduce``: a bucket's gradient cast, division and reduce-scatter (or the
  stage-0 all-reduce), after an event that says the gradient is computed.
- ``replicate``: the hybrid all-reduce of a landed reduce-scatter across
  replica groups (after the ``reduce`` stream's event for that reduce-scatter),
  so the next reduce-scatter is not queued behind it.

On a side stream a collective is issued in order (``async_op=False``): NCCL
then makes that stream wait, not the host, and the stream's own order keeps
the buffers it allocated safe, as in FSDP2. The compute stream never waits
for a collective it does not consume: a
forward or backward pass begins with the side streams waiting for the compute
stream once (``begin_pass``: the optimizer's updates are visible to the next
gathers), and the end of backward makes the compute stream wait for the two
reduction streams once (``join``). No call here reads a value on the host.

Without streams (a CPU, gloo) ``overlaps`` is false and every call does
nothing, so the same engine code runs everywhere; a test can install a
backend that records what would have run (``zerobridge.testing.streams``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

import torch

__all__ = ["ROLES", "Role", "StreamBackend", "Streams", "stream_backend"]

Role = Literal["gather", "reduce", "replicate"]
ROLES: tuple[Role, ...] = ("gather", "reduce", "replicate")


class StreamBackend(Protocol):
    """The stream primitives of one device: ``torch.cuda`` on CUDA, a recorder in tests."""

    def current(self) -> Any:
        """The stream work is issued on now."""

    def new_stream(self, role: Role) -> Any:
        """A side stream for ``role``."""

    def enter(self, stream: Any) -> Any:
        """A context manager that makes ``stream`` current."""

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        """``waiter`` runs nothing new until ``stream``'s work issued so far is done."""

    def record_event(self, stream: Any) -> Any:
        """An event marking the work issued on ``stream`` so far."""

    def wait_event(self, waiter: Any, event: Any) -> None:
        """``waiter`` runs nothing new until ``event`` has happened."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is in use by ``stream``: the allocator may not hand it out
        again before ``stream`` has finished the work issued so far."""


class _Cuda:
    """``StreamBackend`` over ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, role: Role) -> Any:
        # The gathers feed the next compute: FSDP2 gives them high priority.
        return torch.cuda.Stream(self.device, priority=-1 if role == "gather" else 0)

    def enter(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, waiter: Any, event: Any) -> None:
        waiter.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.untyped_storage().nbytes():
            tensor.record_stream(stream)


def stream_backend(device: torch.device) -> StreamBackend | None:
    """The stream primitives of ``device``, or ``None`` where work runs in order (CPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return _Cuda(device)
    return None


class Streams:
    """One engine's side streams (``ROLES``) over the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.backend = stream_backend(device)
        self.side = {role: self.backend.new_stream(role) for role in ROLES} if self.backend else {}

    @property
    def overlaps(self) -> bool:
        """Whether collectives can run beside compute (side streams exist): the engine then
        prefetches the next unit in forward by default, as FSDP2's streams do."""
        return self.backend is not None

    @contextmanager
    def on(self, role: Role) -> Iterator[None]:
        """Issue the work inside on ``role``'s stream."""
        if self.backend is None:
            yield
            return
        with self.backend.enter(self.side[role]):
            yield

    def begin_pass(self) -> None:
        """Every side stream waits for the compute stream's work so far (the optimizer's
        updates, the gradient buffers zeroed): once per forward and per backward."""
        if self.backend is not None:
            current = self.backend.current()
            for stream in self.side.values():
                self.backend.wait_stream(stream, current)

    def mark(self, role: Role | None = None) -> Any:
        """An event after the work issued so far on ``role``'s stream (``None``: the compute
        stream)."""
        if self.backend is None:
            return None
        return self.backend.record_event(self.side[role] if role else self.backend.current())

    def follow(self, role: Role, mark: Any) -> None:
        """``role``'s stream waits for ``mark`` (an event from ``mark``)."""
        if self.backend is not None:
            self.backend.wait_event(self.side[role], mark)

    def use(self, mark: Any, *tensors: torch.Tensor | None) -> None:
        """The compute stream waits for ``mark`` and takes over ``tensors``, allocated on a
        side stream, so freeing them waits for the compute that reads them."""
        if self.backend is None:
            return
        current = self.backend.current()
        if mark is not None:
            self.backend.wait_event(current, mark)
        for tensor in tensors:
            if tensor is not None:
                self.backend.record_stream(tensor, current)

    def lend(self, role: Role, *tensors: torch.Tensor | None) -> None:
        """``tensors``, allocated elsewhere, are read on ``role``'s stream: their memory is
        not reused before that stream is done with them."""
        if self.backend is None:
            return
        for tensor in tensors:
            if tensor is not None:
                self.backend.record_stream(tensor, self.side[role])

    def join(self) -> None:
        """The compute stream waits for every reduction issued (end of backward)."""
        if self.backend is not None:
            current = self.backend.current()
            for role in ("reduce", "replicate"):
                self.backend.wait_stream(current, self.side[role])
