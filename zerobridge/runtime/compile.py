"""Hand a prepared model's units to ``torch.compile``, the engine's hooks outside the graphs.

    >>> import torch
    >>> from zerobridge.runtime.compile import compile_targets
    >>> from zerobridge.spec import CompileScope
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> units = [model, model[0], model[1]]          # the root first, as unit_modules lists them
    >>> [type(m).__name__ for m in compile_targets(units, CompileScope.UNITS)]
    ['Linear', 'Sequential']
    >>> compile_targets(units, CompileScope.MODEL) == [model]
    True

[Note: why the hooks stay eager]
A unit's pre-forward hook gathers its parameters into storage it resizes and
points the module at fresh views; its post-forward and gradient hooks flip
flags the engine mutates in place. Traced into a graph, each of these would be
frozen in (a resize with a symbolic size, a used-flag tensor saved for
backward and then zeroed). So every hook the engine registers is opaque to
dynamo (``torch.compiler.disable``) and the compiled code is a unit's
``forward``: its inputs are the gathered views, the same shapes and strides
every step, so the second step reuses the first step's graph.

``scope: units`` replaces the ``forward`` of every unit that holds no other
unit (with one unit, the root) by its compiled form; a parent unit's own
forward stays eager, as in torchtitan's per-block compile. ``scope: model``
compiles the root's call in place (``nn.Module.compile``), which is what
``torch.compile(model)`` does: its graphs end at every unit's hooks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from zerobridge.errors import ConfigError
from zerobridge.spec import CompileScope, CompileSpec

__all__ = ["apply_compile", "check_compile", "compile_targets", "is_compiled_wrapper", "unwrap_compiled"]


def compile_targets(units: Sequence[nn.Module], scope: CompileScope) -> list[nn.Module]:
    """The modules whose forward is compiled: ``units`` lists the root first."""
    if scope is CompileScope.MODEL or len(units) == 1:
        return [units[0]]
    unit_ids = {id(u) for u in units}
    leaves = []
    for unit in units[1:]:
        inner = (m for m in unit.modules() if m is not unit)
        if not any(id(m) in unit_ids for m in inner):
            leaves.append(unit)
    return leaves


def check_compile(spec: CompileSpec) -> None:
    """Refuse what cannot compile, before anything is built."""
    if not spec.enabled:
        return
    known = torch._dynamo.list_backends(exclude_tags=())
    if spec.backend not in known:
        raise ConfigError(f"compile.backend={spec.backend!r} is not a torch.compile backend", key="compile.backend",
                          fix=f"choose one of {', '.join(sorted(known))}")
    if spec.fullgraph and spec.scope is CompileScope.MODEL:
        raise ConfigError("compile.fullgraph with scope 'model' cannot hold: the graphs end at every unit's "
                          "hooks, which gather and reduce outside them", key="compile.fullgraph",
                          fix="set compile.scope='units' (each unit's forward one graph) or fullgraph=false")


def apply_compile(units: Sequence[nn.Module], spec: CompileSpec) -> list[nn.Module]:
    """Compile as ``spec`` says; return the modules compiled (none when it is off)."""
    if not spec.enabled:
        return []
    check_compile(spec)
    _warn_cache(units[0])
    targets = compile_targets(units, spec.scope)
    if spec.scope is CompileScope.MODEL:
        targets[0].compile(**spec.kwargs())
        return targets
    for module in targets:
        # An instance attribute: the class's forward, and the module's hooks, stay as they were.
        module.forward = torch.compile(module.forward, **spec.kwargs())
    return targets


def _warn_cache(root: nn.Module) -> None:
    config = getattr(root, "config", None)
    if getattr(config, "use_cache", False) and root.training:
        warnings.warn(f"{type(root).__name__}.config.use_cache is True: each layer's forward writes its own KV-cache "
                      "entry, so dynamo compiles one graph per layer and runs the layers past its recompile limit "
                      "(torch._dynamo.config.recompile_limit, 8) eagerly; set model.config.use_cache = False to "
                      "train compiled", stacklevel=3)


def is_compiled_wrapper(model: nn.Module) -> bool:
    """``model`` is what ``torch.compile(module)`` returned."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``model`` itself when it is not a wrapper):
    sharding applies to it, so names and checkpoints carry no ``_orig_mod.`` prefix."""
    return model._orig_mod if is_compiled_wrapper(model) else model  # type: ignore[return-value]
