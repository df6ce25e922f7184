"""Put a model on torch FSDP2: one ``apply_*`` function per concern, in the order ``prepare`` runs them.

    >>> import torch
    >>> from zerobridge.backends.fsdp.apply import plan_units
    >>> from zerobridge.spec import EveryModuleWrap
    >>> tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    >>> tied["head"].weight = tied["embed"].weight
    >>> cut = plan_units(tied, EveryModuleWrap())
    >>> [len(cut.sharded), [e.note for e in cut.merged]]   # neither owns the tied weight: both stay in the root
    [0, []]

Order: ``broadcast_from_rank0`` (the native engine starts every rank from
rank 0's values), ``cast_states`` (master and buffer dtypes),
``apply_activation_checkpointing`` (on the native units' forwards),
``apply_fully_shard`` (innermost unit first, the root last), and after it
``replace_optimizer_params``. The units are the native engine's
(``zerobridge.runtime.wrap_units``): a parameter used by modules of several units
belongs to their closest common enclosing unit, which FSDP2 expresses by not
sharding an inner unit that owns nothing of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from zerobridge.engine import collectives
from zerobridge.errors import ConfigError
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.unit_wrap import checkpointed
from zerobridge.runtime.wrap_units import collect_params, owners, unit_modules
from zerobridge.spec import WrapSpec
from zerobridge.translate.report import Entry, Status

__all__ = [
    "UnitCut", "apply_activation_checkpointing", "apply_fully_shard", "broadcast_from_rank0",
    "cast_states", "first_names", "plan_units", "replace_optimizer_params",
]


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks that split one copy of the sharded states (the mesh's last dimension)."""
    return mesh.get_group(mesh.ndim - 1)


def broadcast_from_rank0(model: nn.Module) -> None:
    """Every parameter and buffer takes rank 0's values, as the native engine starts."""
    collectives.broadcast_module(model, 0, dist.group.WORLD, CommStats())  # counted by the backend's own hooks


def cast_states(model: nn.Module, *, master: torch.dtype, buffers: torch.dtype | None) -> None:
    """Floating parameters to the master dtype (FSDP2 shards and steps the loaded dtype, so that
    dtype must be the master's); floating buffers to ``buffers`` when the spec names one."""
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != master:
                param.data = param.data.to(master)
        if buffers is not None:
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[name] = buf.to(buffers)


def apply_activation_checkpointing(model: nn.Module, wrap: WrapSpec) -> None:
    """Recompute each unit's activations in backward (the root's when it is the only unit), as the
    native engine does: the unit's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``."""
    units = unit_modules(model, wrap)
    for module in units[1:] or [model]:
        module.forward = checkpointed(module.forward)


@dataclass
class UnitCut:
    """Which native units get their own ``fully_shard`` call (innermost first)."""

    sharded: list[nn.Module] = field(default_factory=list)
    merged: list[Entry] = field(default_factory=list)
    """Units that hold a parameter of an enclosing unit (FSDP2 would claim it): merged into
    their enclosing unit, an approximation."""


def plan_units(model: nn.Module, wrap: WrapSpec) -> UnitCut:
    """The native units FSDP2 can shard as they are. A unit whose parameters all belong to an
    enclosing unit (a tied weight) owns nothing and is left to it, as the native engine does."""
    units = unit_modules(model, wrap)
    refs = collect_params(model)
    owner = {id(ref.param): index for ref, index in zip(refs, owners(model, units, refs))}
    names = {id(m): n for n, m in model.named_modules()}
    claimed: set[int] = set()  # modules inside a unit already cut
    cut = UnitCut()
    post = {id(m): i for i, m in enumerate(_post_order(model))}
    for index in sorted(range(1, len(units)), key=lambda i: post[id(units[i])]):  # descendants first
        unit = units[index]
        modules = [m for m in unit.modules() if id(m) not in claimed]
        params = {id(p) for m in modules for p in m._parameters.values() if p is not None}
        mine = {pid for pid in params if owner[pid] == index}
        if not mine:
            continue
        if mine != params:
            cut.merged.append(Entry("wrapping", Status.APPROXIMATED, f"unit {names[id(unit)]!r} holds a parameter "
                                    "of an enclosing unit (a tied weight), which FSDP2 cannot leave out of it: "
                                    "merged into the enclosing unit"))
            continue
        cut.sharded.append(unit)
        claimed.update(id(m) for m in modules)
    return cut


def _post_order(module: nn.Module) -> list[nn.Module]:
    """``module``'s tree, every module after its children, siblings in registration order."""
    out: list[nn.Module] = []
    for child in module.children():
        out += _post_order(child)
    return [*out, module]


def apply_fully_shard(model: nn.Module, cut: UnitCut, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` each cut unit (innermost first), then the root."""
    for unit in cut.sharded:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def first_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` to its first fully qualified name."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def replace_optimizer_params(optimizer: torch.optim.Optimizer, before: dict[int, str], model: nn.Module) -> None:
    """Swap the original parameters in ``optimizer``'s groups for the sharded ones, by name;
    groups and hyperparameters stay."""
    after = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    if len(held) != len(set(held)):
        raise ConfigError("the optimizer holds a parameter twice (a tied weight under two names?)", key="optimizer",
                          fix="build the optimizer from model.parameters(), which lists each parameter once")
