"""Cut a model into wrap units and decide which unit owns each parameter.

    >>> import torch
    >>> from zerobridge.runtime.wrap_units import collect_params, owners, unit_modules
    >>> from zerobridge.spec.wrapping import EveryModuleWrap
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> units = unit_modules(model, EveryModuleWrap())
    >>> [type(u).__name__ for u in units]
    ['Sequential', 'Linear', 'Linear']
    >>> refs = collect_params(model)
    >>> [(r.names[0], owner) for r, owner in zip(refs, owners(model, units, refs))]
    [('0.weight', 1), ('0.bias', 1), ('2.weight', 2), ('2.bias', 2)]

A unit's parameters are gathered, reduced and freed together. A parameter
used by modules of several units (tied weights) belongs to their closest
common enclosing unit, which is gathered for as long as all of them run.
``bucket_sizes`` counts what DeepSpeed's buckets are sized by, the largest unit and
the whole model (``translate/deepspeed_buckets.py``):

    >>> from zerobridge.spec import CommunicationSpec, StrategySpec
    >>> spec = StrategySpec(wrapping=EveryModuleWrap(), communication=CommunicationSpec(reduce_bucket="per_unit"))
    >>> bucket_sizes(model, spec)
    BucketSizes(elements=6, unit='0', ranks=None, model=10, hidden=None)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerobridge.errors import ConfigError
from zerobridge.runtime.plan import hidden_size
from zerobridge.spec import StrategySpec
from zerobridge.spec.wrapping import EveryModuleWrap, RootWrap, SizeWrap, TransformerWrap, WrapSpec
from zerobridge.translate.deepspeed_buckets import BucketSizes

__all__ = ["ParamRef", "bucket_sizes", "collect_params", "layer_class_names", "owners", "unit_modules"]


@dataclass(frozen=True)
class ParamRef:
    """An original parameter and every place it is registered."""

    param: nn.Parameter | None
    """The original; dropped (``None``) once its values are in a flat group."""
    shape: torch.Size
    requires_grad: bool
    source_id: int
    """``id()`` of the original parameter, to replace it in a user's optimizer."""
    names: tuple[str, ...]
    """Fully qualified names; more than one for tied parameters."""
    slots: tuple[tuple[nn.Module, str], ...]
    """(module, attribute) pairs holding it."""
    order: int
    """Position in registration order (first occurrence)."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


def collect_params(model: nn.Module) -> list[ParamRef]:
    """Every distinct parameter with all its names and (module, attribute) slots."""
    found: dict[int, tuple[nn.Parameter, list[str], list[tuple[nn.Module, str]], int]] = {}
    seen_slots: set[tuple[int, str]] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{module_name}.{attr}" if module_name else attr
            entry = found.setdefault(id(param), (param, [], [], len(found)))
            if fqn not in entry[1]:
                entry[1].append(fqn)
            if (id(module), attr) not in seen_slots:
                seen_slots.add((id(module), attr))
                entry[2].append((module, attr))
    return [ParamRef(param=p, shape=p.shape, requires_grad=p.requires_grad, source_id=id(p), names=tuple(names),
                     slots=tuple(slots), order=order)
            for p, names, slots, order in found.values()]


def layer_class_names(model: nn.Module, wrap: TransformerWrap) -> tuple[str, ...]:
    """The layer class names a transformer wrap cuts at: its own, or (``"auto"``) the model's
    ``_no_split_modules`` as Hugging Face declares them."""
    if wrap.layer_classes != "auto":
        return tuple(wrap.layer_classes)
    names = getattr(model, "_no_split_modules", None)
    if not names:
        raise ConfigError(
            f"wrapping.layer_classes is 'auto' but {type(model).__name__} declares no _no_split_modules",
            key="wrapping.layer_classes",
            fix="name the repeated layer classes, e.g. layer_classes=['Block'], or use policy='every_module'")
    return tuple(names)


def unit_modules(model: nn.Module, wrap: WrapSpec) -> list[nn.Module]:
    """The unit modules, the root first, then in registration (pre-)order."""
    modules = [m for _, m in model.named_modules()]
    if isinstance(wrap, RootWrap):
        return [model]
    if isinstance(wrap, TransformerWrap):
        classes = layer_class_names(model, wrap)
        chosen = [m for m in modules[1:] if type(m).__name__ in classes]
        if not chosen:
            present = sorted({type(m).__name__ for m in modules})
            raise ConfigError(
                f"wrapping.layer_classes {list(classes)} match no module of {type(model).__name__}",
                key="wrapping.layer_classes",
                fix=f"choose among the model's classes: {', '.join(present)}")
        return [model, *chosen]
    if isinstance(wrap, EveryModuleWrap):
        units: list[nn.Module] = [model]
        inside_leaf: set[int] = set()
        for m in modules[1:]:
            if id(m) in inside_leaf:
                continue
            if type(m).__name__ in wrap.leaf_classes:
                units.append(m)
                inside_leaf.update(id(sub) for sub in m.modules())
            elif any(p is not None for p in m._parameters.values()):
                units.append(m)
        return units
    assert isinstance(wrap, SizeWrap)
    chosen_ids: set[int] = set()

    def unwrapped(module: nn.Module) -> int:
        total = sum(p.numel() for p in module._parameters.values() if p is not None)
        total += sum(unwrapped(child) for child in module.children())
        # A container is never called, so its hooks would never gather it: its children decide (as torch's
        # size-based wrap policy excludes ModuleList and ModuleDict).
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if module is not model and total >= wrap.min_params and not container:
            chosen_ids.add(id(module))
            return 0
        return total

    unwrapped(model)
    return [model, *(m for m in modules[1:] if id(m) in chosen_ids)]


def owners(model: nn.Module, units: list[nn.Module], refs: list[ParamRef]) -> list[int]:
    """For each parameter, the index (in ``units``) of the unit that owns it."""
    unit_index = {id(u): i for i, u in enumerate(units)}
    paths: dict[int, list[tuple[int, ...]]] = {}

    def walk(module: nn.Module, path: tuple[int, ...]) -> None:
        index = unit_index.get(id(module))
        if index is not None and index != 0 and (not path or path[-1] != index):
            path = (*path, index)
        paths.setdefault(id(module), []).append(path)
        for child in module._modules.values():
            if child is not None:
                walk(child, path)

    walk(model, ())
    result = []
    for ref in refs:
        candidates = [p for module, _ in ref.slots for p in paths[id(module)]]
        common = candidates[0]
        for path in candidates[1:]:
            k = 0
            while k < min(len(common), len(path)) and common[k] == path[k]:
                k += 1
            common = common[:k]
        result.append(common[-1] if common else 0)
    return result


def bucket_sizes(model: nn.Module, spec: StrategySpec, *, world_size: int | None = None) -> BucketSizes:
    """DeepSpeed's bucket sizes for ``model`` cut by ``spec.wrapping``: its largest unit's parameter
    count (tied parameters once, in the unit that owns them), sharded over ``world_size`` ranks (or the
    spec's, when either is known), and the whole model's count. Every entry point that writes DeepSpeed
    for a known model calls it. Works on the meta device."""
    units = unit_modules(model, spec.wrapping)
    refs = collect_params(model)
    counts = [0] * len(units)
    for ref, owner in zip(refs, owners(model, units, refs)):
        counts[owner] += ref.numel
    largest = max(range(len(units)), key=counts.__getitem__)
    names = {id(m): name for name, m in model.named_modules()}
    return BucketSizes.for_unit(counts[largest], unit=names[id(units[largest])],
                                ranks=world_size or spec.sharding.world_size, model=sum(counts),
                                hidden=hidden_size(model))
