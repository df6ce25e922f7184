"""The accumulation window: which backward passes reduce, and which one closes the window for the step.

    >>> from zerobridge.runtime.window import AccumulationWindow
    >>> from zerobridge.spec import GradSync
    >>> window = AccumulationWindow(accumulation_steps=2, grad_sync=GradSync.ACCUMULATION_BOUNDARY)
    >>> window.begin(), window.boundary, window.reduces      # the first backward opens the window
    (True, False, False)
    >>> window.end(), window.state.name                      # ... and leaves it open
    (False, 'ACCUMULATING')
    >>> window.begin(), window.boundary, window.reduces      # the second one is the boundary
    (False, True, True)
    >>> window.end(), window.state.name, window.at_boundary  # the optimizer (and scheduler) step now
    (True, 'EMPTY', True)

[Note: the accumulation window]
An optimizer step consumes the gradients of ``accumulation_steps`` backward
passes (micro-steps). Every backend follows the same rule, kept here once:

- a backward pass outside ``no_sync`` whose micro-step is the
  ``accumulation_steps``-th of the window is the *boundary*: it closes the
  window, and the gradients are ready for the optimizer step;
- a backward pass *reduces* its gradients across ranks at the boundary, and
  also between boundaries when the spec says ``grad_sync=every_micro_step``
  (ZeRO-2 and 3 reduce each micro-step into the sharded accumulator) and no
  ``no_sync`` block is open; otherwise it accumulates locally;
- a backward pass inside ``no_sync`` never closes the window (the next one
  outside reduces everything), as DDP and FSDP do.

What each backend does at these points differs: the native engine opens its
groups' accumulators when the window opens and hands the optimizer its
gradients when it closes (``engine/engine.py``), the FSDP2 backend tells
``set_requires_gradient_sync`` and puts aside the reduced shards of earlier
micro-steps (``backends/fsdp/step.py``), the DeepSpeed backend tells
``set_gradient_accumulation_boundary`` (``backends/deepspeed/step.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

from zerobridge.spec import GradSync

__all__ = ["NO_GRADIENTS", "AccumulationWindow", "WindowState", "no_gradients"]

NO_GRADIENTS = ("clip_grad_norm_ needs gradients: call it after backward at an accumulation boundary (outside "
                "no_sync), before optimizer.step(): guard it with `if zerobridge.is_accumulation_boundary(model):`")
"""What every backend says when gradients are asked for before a boundary handed them over."""


def no_gradients() -> RuntimeError:
    """The error for clipping (or reading the norm) when no boundary has handed the optimizer gradients."""
    return RuntimeError(NO_GRADIENTS)


class WindowState(Enum):
    """Where an accumulation window stands."""

    EMPTY = "empty"
    """No backward pass since the last boundary: the next one opens a window (accumulators start from zero)."""
    BACKWARD = "backward"
    """A backward pass is running; ``boundary`` and ``reduces`` hold for it."""
    ACCUMULATING = "accumulating"
    """Micro-steps of this window ran backward and the boundary has not come: gradients wait locally
    (or, reduced, in the sharded accumulator)."""


class AccumulationWindow:
    """The accumulation rule of one prepared model (see the note above)."""

    def __init__(self, accumulation_steps: int, grad_sync: GradSync = GradSync.ACCUMULATION_BOUNDARY) -> None:
        self.accumulation_steps = accumulation_steps
        self.grad_sync = grad_sync
        self.state = WindowState.EMPTY
        self.micro = 0
        """Backward passes finished in the open window."""
        self.boundary = False
        """The running (or last) backward pass closes the window."""
        self.reduces = False
        """The running (or last) backward pass reduces its gradients across ranks."""
        self._no_sync_depth = 0

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass is running."""
        return self.state is WindowState.BACKWARD

    @property
    def at_boundary(self) -> bool:
        """Whether the last backward pass closed the window, so that the optimizer steps on whole gradients
        (and a scheduler should step with it); before any backward pass of a window, whether the next one
        will close it. False while micro-steps accumulate."""
        if self.state is WindowState.ACCUMULATING:
            return False
        if self.state is WindowState.BACKWARD:
            return self.boundary
        return self.boundary or (self.syncing and self.micro + 1 >= self.accumulation_steps)

    @property
    def syncing(self) -> bool:
        """Whether no ``no_sync`` block is open."""
        return self._no_sync_depth == 0

    def begin(self) -> bool:
        """A backward pass starts: decide ``boundary`` and ``reduces`` for it. Returns whether it
        opens a new window. Only from ``EMPTY`` or ``ACCUMULATING``."""
        if self.state is WindowState.BACKWARD:
            raise RuntimeError("a backward pass began while another one was running on the same model")
        opened = self.state is WindowState.EMPTY
        self.boundary = self.syncing and self.micro + 1 >= self.accumulation_steps
        self.reduces = self.boundary or (self.syncing and self.grad_sync is GradSync.EVERY_MICRO_STEP)
        self.state = WindowState.BACKWARD
        return opened

    def end(self) -> bool:
        """The backward pass finished. Returns whether it closed the window (the boundary):
        then the window is ``EMPTY`` again, else ``ACCUMULATING``."""
        if self.state is not WindowState.BACKWARD:
            raise RuntimeError("a backward pass ended that never began")
        if self.boundary:
            self.micro = 0
            self.state = WindowState.EMPTY
            return True
        self.micro += 1
        self.state = WindowState.ACCUMULATING
        return False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and never close the window."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
