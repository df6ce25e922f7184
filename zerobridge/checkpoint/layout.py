"""Where each value lives in a checkpoint: its key, and the boxes of a tensor a rank holds.

    >>> from zerobridge.checkpoint.layout import run_boxes
    >>> [(b.offsets, b.sizes) for b in run_boxes((4, 5), 3, 17)]   # elements 3..16 of a 4x5 tensor
    [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    >>> from zerobridge.checkpoint.layout import optim_state_key, key_path
    >>> optim_state_key("layers.0.up.weight", "exp_avg")
    'optim.state.layers.0.up.weight.exp_avg'
    >>> key_path("optim.param_groups.1.lr")
    ('optim', 'param_groups', 1, 'lr')

Keys are the ones ``torch.distributed.checkpoint`` writes for
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``
on an FSDP2 model, so either side loads the other's checkpoint:

- ``model.<fqn>``: every parameter under every name (a tied weight under each)
  and every persistent buffer;
- ``optim.state.<fqn>.<key>``: optimizer state under the parameter's first
  name, only for parameters that have state;
- ``optim.param_groups.<i>.<key>``: hyperparameters of group ``i``, and
  ``params``, the list of first names of its parameters;
- ``zerobridge.*``: what only zerobridge reads (RNG per rank, loss scaler,
  skipped steps, the saving layout, user metadata).

An engine rank owns one contiguous run ``[start, stop)`` of a flattened
parameter. A run of a row-major tensor is a few *boxes*, each a fixed index
prefix, a range in one dimension and the whole trailing dimensions, so each
box is itself contiguous in memory; DCP stores each box as a chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Box", "ZB", "intersect", "key_path", "model_key", "optim_state_key", "param_group_key", "rank_key",
           "run_boxes", "whole"]

ZB = "zerobridge"
"""Prefix of zerobridge's own keys."""


def model_key(fqn: str) -> str:
    return f"model.{fqn}"


def optim_state_key(fqn: str, state_key: str) -> str:
    return f"optim.state.{fqn}.{state_key}"


def param_group_key(index: int, key: str) -> str:
    return f"optim.param_groups.{index}.{key}"


def rank_key(rank: int, what: str) -> str:
    """A per-rank extra, e.g. ``zerobridge.rng.1.torch``."""
    return f"{ZB}.rng.{rank}.{what}"


def key_path(key: str, fqn: str | None = None) -> tuple[str | int, ...]:
    """The nested path DCP records for a flat key (``Metadata.planner_data``):
    a model or optimizer-state fqn stays one element; group indices are ints."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optim.state.") and fqn is not None:
        return ("optim", "state", fqn, key[len(f"optim.state.{fqn}."):])
    if key.startswith("optim.param_groups."):
        _, _, index, name = key.split(".", 3)
        return ("optim", "param_groups", int(index), name)
    return tuple(key.split("."))


@dataclass(frozen=True)
class Box:
    """An N-d box of a tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def whole(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor (a 0-d tensor: the empty box ``()``)."""
    return Box((0,) * len(shape), tuple(shape))


def flat_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Row-major position of the element at ``offsets``."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


def run_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes in
    flat order (at most ``2 * ndim - 1``), each contiguous in memory."""
    if stop <= start:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    rest = tuple(shape[1:])
    if first == last:  # inside one slice of dimension 0
        return [Box((first, *b.offsets), (1, *b.sizes)) for b in run_boxes(rest, first_off, last_off)]
    boxes: list[Box] = []
    if first_off:
        boxes += [Box((first, *b.offsets), (1, *b.sizes)) for b in run_boxes(rest, first_off, inner)]
        first += 1
    if last > first:
        boxes.append(Box((first,) + (0,) * len(rest), (last - first, *rest)))
    if last_off:
        boxes += [Box((last, *b.offsets), (1, *b.sizes)) for b in run_boxes(rest, 0, last_off)]
    return boxes


def box_start(shape: tuple[int, ...], box: Box) -> int:
    """Flat position of a box's first element."""
    return flat_index(shape, box.offsets)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``; ``None`` when they do not meet."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))
