"""The module views of a flat group's buckets (``show`` before a unit's forward, ``hide`` after), and
where the replicated groups' are cut: again right before the first module that uses each bucket in a
forward pass, so each bucket's gradient is ready as soon as backward has passed that module.

    >>> import torch, zerobridge
    >>> from zerobridge.spec import CommunicationSpec, StrategySpec
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> spec = StrategySpec(communication=CommunicationSpec(reduce_bucket=20))   # stage 0, one bucket per layer
    >>> model = zerobridge.prepare(model, config=spec)
    >>> engine = model._zerobridge_engine
    >>> fired = []
    >>> for b, leaf in enumerate(engine.replicated[0].leaves):
    ...     _ = leaf.register_post_accumulate_grad_hook(lambda leaf, b=b: fired.append(b))
    >>> x = torch.ones(2, 4, requires_grad=True)
    >>> _ = x.register_hook(lambda grad: fired.append("input"))   # the first layer's backward made it
    >>> model(x).sum().backward()
    >>> fired            # the last layer's bucket (0) is ready before the first layer's backward runs
    [0, 'input', 1]

[Note: why the moment a view is cut matters]
A bucket's views are cut from its leaf by one split node (``show_bucket``),
and the bucket's gradient hook fires when that node has run. Among the nodes ready at
once, torch's autograd engine runs the one created last first (``sequence_nr``).
Cut in the root's pre-forward, before any forward op, every split node is older
than the whole forward: it is ready once backward has passed the bucket's
modules, but runs only when nothing else is left. So every bucket of the
replicated groups (all parameters at stages 0-2) fired at the end of backward:
each parameter's gradient was held until then, and no reduction overlapped the
backward. DDP and DeepSpeed hook each parameter's own accumulation node, which
torch runs first of all (its ``sequence_nr`` is the largest), so theirs fire as
the gradients are made.

Cut again right before the first module that uses it (``ReplicatedViews``), the split
node is younger than every op before that module and runs as soon as backward
has passed it (a group of one bucket is not cut again: its one gradient is
ready only when backward has passed all its modules, wherever it is cut). The
root's pre-forward still cuts every bucket, so a parameter
read outside its module's forward sees a full-shape view; a view it took is
still part of the graph, and its gradient reaches the same leaf.

Under ``torch.compile`` a hook inside a compiled forward would break its graph:
there the first use is the parameter's unit, whose hooks run
outside the graphs, and the root's parameters keep the root's cut. Sharded
groups need none of this: a unit's pre-forward cuts their views right before
its forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerobridge.engine.flat_group import FlatGroup
from zerobridge.runtime.wrap_units import owners
from zerobridge.spec import CompileSpec

__all__ = ["ReplicatedViews", "hide", "show", "show_bucket"]


def show(group: FlatGroup, mark_used: bool) -> None:
    """Point every module slot of ``group`` at a full-shape view of its gathered leaves."""
    for b in range(len(group.layout.buckets)):
        show_bucket(group, b, mark_used)


def show_bucket(group: FlatGroup, b: int, mark_used: bool) -> None:
    """Point the slots of bucket ``b``'s parameters at fresh views of its leaf, cut by one split node;
    ``mark_used``: each view notes in ``group.used`` that its parameter got a gradient."""
    bucket = group.layout.buckets[b]
    pieces = group.leaves[b].split(group.layout.split_sizes(bucket))
    for k, i in enumerate(bucket.params):
        view = pieces[k].view(group.refs[i].shape)
        if mark_used and view.requires_grad:
            view.register_hook(_marks_used(group, i))
        for module, attr in group.refs[i].slots:
            module._parameters[attr] = view


def _marks_used(group: FlatGroup, i: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        group.used[i] = True
    return hook


def hide(group: FlatGroup) -> None:
    """Put ``group``'s sharded parameters back on the modules."""
    for ref, param in zip(group.refs, group.params):
        for module, attr in ref.slots:
            module._parameters[attr] = param


class ReplicatedViews:
    """Shows the replicated ``groups``' views for a forward pass (``begin`` to ``end``), and cuts each
    trainable bucket again at the first of its modules that runs in it."""

    def __init__(self, groups: Sequence[FlatGroup], units: Sequence[nn.Module], compile: CompileSpec) -> None:
        """``units``: the wrap units, the root (the model) first; ``compile``: the spec's (under
        ``torch.compile`` a bucket is cut at its parameters' units, not their modules)."""
        self.groups = list(groups)
        self.active = False
        """A forward pass that records gradients is running (outside a backward recomputation)."""
        self.shown: set[tuple[int, int]] = set()
        self.points: dict[int, list[tuple[FlatGroup, int]]] = {}
        """Per hooked module (by id), the buckets cut at it."""
        # one bucket fires once its last gradient is made, wherever it is cut: it stays cut at the root
        for group in (g for g in groups if g.plan.trainable and len(g.layout.buckets) > 1):
            owner = owners(units[0], list(units), group.refs) if compile.enabled else []
            for b, bucket in enumerate(group.layout.buckets):
                for i in bucket.params:
                    at = [units[owner[i]]] if compile.enabled else [module for module, _ in group.refs[i].slots]
                    for module in (m for m in at if m is not units[0]):
                        if id(module) not in self.points:
                            self.points[id(module)] = []
                            module.register_forward_pre_hook(torch.compiler.disable(self._hook(id(module))))
                        if (group, b) not in self.points[id(module)]:
                            self.points[id(module)].append((group, b))

    def begin(self, mark_used: bool) -> None:
        """A forward pass begins: show every view; ``mark_used``: it records gradients (the views note
        their use, and each bucket is cut again at its first use)."""
        for group in self.groups:
            show(group, mark_used)
        self.active = mark_used
        self.shown.clear()

    def end(self) -> None:
        """The forward pass ended: put the parameters back (a backward recomputation shows the views
        again, ``Engine._pre_backward``, and they are not cut again)."""
        self.active = False
        for group in self.groups:
            hide(group)

    def _hook(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            # views cut without gradients would carry none: a bucket first used under no_grad is cut at
            # its next use that records them (or keeps the root's cut)
            if not self.active or not torch.is_grad_enabled():
                return
            for group, b in self.points[key]:
                if (id(group), b) not in self.shown:
                    self.shown.add((id(group), b))
                    show_bucket(group, b, mark_used=True)  # only a pass that records gradients cuts again
        return hook
