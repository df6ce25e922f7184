"""One parameter stepped a range of its elements at a time, for optimizers whose update is elementwise.

    >>> import torch
    >>> from zerobridge.engine.param_range import RangeStep, ranges
    >>> ranges(10, cap=4)                          # about equal ranges of at most ``cap`` elements
    [(0, 3), (3, 6), (6, 10)]
    >>> p = torch.nn.Parameter(torch.ones(2, 5))
    >>> optimizer = torch.optim.AdamW([p], lr=0.1)
    >>> with RangeStep(optimizer, p) as stepping:  # the state is whole again after the block
    ...     for start, stop in ranges(p.numel(), cap=4):
    ...         with stepping.narrowed(start, stop):   # the optimizer sees p as its elements start:stop
    ...             p.grad = torch.ones(stop - start)
    ...             optimizer.step()
    >>> p.shape, optimizer.state[p]["exp_avg"].shape, float(optimizer.state[p]["step"])
    (torch.Size([2, 5]), torch.Size([2, 5]), 1.0)

torch's single-tensor AdamW makes two temporaries the size of the tensor it steps
(``exp_avg_sq.sqrt()`` and its quotient), its foreach form one per tensor of the
step; the engine's tiled step (``step.py``) bounds them by stepping a few parameters
at a time, but a parameter larger than a tile is still stepped whole. For the
optimizers in ``ELEMENTWISE`` (each element's update reads only that element's
gradient, value and state, plus per-parameter scalars such as AdamW's ``step``)
stepping the ranges of a parameter in turn is bit-identical to stepping it
whole, so such a parameter is stepped in ranges: the parameter's ``.data``, its
gradient and its state tensors are narrowed to views of the range for one step
call, and its scalar state (``step``) starts every range from the value it had
before the first. On the first step (no state yet) the optimizer creates each
range's state, which is copied into full-size tensors, allocated once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ELEMENTWISE", "RangeStep", "elementwise", "ranges", "splits"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers (these exact classes, not subclasses, which may read a whole tensor) whose update
of each element reads only that element and per-parameter scalars."""

SPLIT_MIN = 1 << 16
"""A parameter is split only when it is larger than the tile and than this many elements:
smaller ones add little to a step's peak, and each range is one more optimizer call."""


def elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer`` is one of ``ELEMENTWISE``."""
    return type(optimizer) in ELEMENTWISE


def splits(optimizer: torch.optim.Optimizer, numel: int, cap: int) -> bool:
    """A parameter of ``numel`` elements is stepped in ranges of at most ``cap`` by ``optimizer``."""
    return elementwise(optimizer) and numel > max(cap, SPLIT_MIN)


def ranges(numel: int, *, cap: int) -> list[tuple[int, int]]:
    """``0..numel`` in the fewest ranges of at most ``cap`` elements, of about equal size."""
    count = -(-numel // max(cap, 1))
    bounds = [numel * k // count for k in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class RangeStep:
    """The ranges of one parameter stepped in turn in one optimizer step (a ``with`` block around them)."""

    def __init__(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
        self.optimizer = optimizer
        self.param = param
        self.whole = param.data
        """The parameter's own tensor, put back after each range."""
        self.fresh = not optimizer.state.get(param)
        """No state yet: each range's state is created by the optimizer and copied into ``state``."""
        self.state: dict[str, Any] = dict(optimizer.state.get(param, {}))
        self.scalars = {k: _copy(v) for k, v in self.state.items() if not self._elementwise(v, self.whole)}
        """The per-parameter values before the step; each range starts from them."""
        self.flat = self.whole.view(-1)
        """The parameter's elements in one dimension, each range a slice of it (one view for every range)."""
        self.flat_state = {k: v.view(-1) for k, v in self.state.items() if self._elementwise(v, self.whole)}
        """The elementwise state the same way (empty on the first step)."""

    @staticmethod
    def _elementwise(value: Any, like: torch.Tensor) -> bool:
        return isinstance(value, torch.Tensor) and value.shape == like.shape and value.dim() > 0

    @contextmanager
    def narrowed(self, start: int, stop: int) -> Iterator[None]:
        """Within the block the optimizer sees the parameter as its elements ``start:stop``
        (a flat view; its gradient must be set to that shape inside the block)."""
        part = self.flat[start:stop]
        views = {} if self.fresh else {k: v[start:stop] for k, v in self.flat_state.items()}
        self.optimizer.state[self.param] = {**{k: _copy(v) for k, v in self.scalars.items()}, **views}
        self.param.data = part
        try:
            yield
        finally:
            self.param.grad = None
            self.param.data = self.whole
            stepped = self.optimizer.state.get(self.param, {})
            if self.param in self.optimizer.state:  # the key keeps its place: state_dict order is unchanged
                self.optimizer.state[self.param] = {}
        for key, value in stepped.items():
            if not self._elementwise(value, part):
                self.state[key] = value
            elif value is not views.get(key):  # created by the optimizer (the first step), or replaced
                if key not in self.state:
                    self.state[key] = torch.empty_like(self.whole, dtype=value.dtype)
                self.state[key].view(-1)[start:stop].copy_(value)
        del stepped

    def __enter__(self) -> RangeStep:
        return self

    def __exit__(self, *exc: object) -> None:
        """Every range stepped (or the step raised): the optimizer's state for the parameter is whole again."""
        if self.state:
            self.optimizer.state[self.param] = self.state


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
