"""The native engine as a backend: ``zerobridge.prepare(model, ...)`` with ``backend="native"`` (the default).

    >>> import torch
    >>> from zerobridge.backends.native.prepare import ZeroModule
    >>> from zerobridge.spec.presets import spec_for_stage
    >>> from zerobridge.backends.native.prepare import prepare
    >>> model = prepare(torch.nn.Linear(4, 2), None, spec_for_stage(3), allow_approximate=False)
    >>> isinstance(model, ZeroModule), type(model).__name__
    (True, 'ZeroLinear')

The steps, in order: start the process group (binding this rank's
accelerator), replay a meta model's construction on every rank from rank
0's generator, plan the engine for this world size, build its process
groups, build the engine (flat groups, hooks), write a meta model's values
into the groups, give the model its ``ZeroModule`` class and its backend,
compile each unit (after the hooks exist: they stay outside the graphs),
and point the user's optimizer at the sharded parameters. The native engine
runs every spec exactly: ``allow_approximate`` has nothing to allow.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from zerobridge.backends.base import adopt_class, check_fresh, set_backend, start_run
from zerobridge.backends.native.backend import NativeBackend
from zerobridge.backends.native.materialize import materialize_engine
from zerobridge.engine import Engine, plan_engine
from zerobridge.engine.mesh import build_mesh
from zerobridge.errors import ConfigError
from zerobridge.runtime.compile import apply_compile
from zerobridge.runtime.deferred_init import Replay
from zerobridge.spec import StrategySpec, WireFormat

__all__ = ["ZeroModule", "prepare", "refuse_moving"]


class ZeroModule(nn.Module):
    """Mixed into a prepared model's class: the model keeps its own class and names."""

    _zerobridge_engine: Engine

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient communication: accumulate locally until a backward outside."""
        return self._zerobridge_engine.no_sync()

    @property
    def zerobridge_engine(self) -> Engine:
        """The engine that runs this model."""
        return self._zerobridge_engine

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ZeroModule:
        """``.to()``, ``.cuda()``, ``.half()``, ``.float()``, ...: refused when they would move or
        cast a parameter the engine owns (it would leave the engine's flat buffers behind
        and train stale copies); a conversion that changes none of them goes through."""
        refuse_moving(self, self._zerobridge_engine, fn)
        return super()._apply(fn, recurse)


def refuse_moving(model: nn.Module, engine: Engine, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``ConfigError`` when ``fn`` (a module conversion) would change the dtype or device of a
    sharded parameter. Probed on an empty tensor of each kind, so nothing is copied."""
    seen: set[tuple[torch.dtype, torch.device]] = set()
    for group in engine.groups:
        for param in group.params:
            kind = (param.dtype, param.device)
            if kind in seen:
                continue
            seen.add(kind)
            moved = fn(torch.empty(0, dtype=param.dtype, device=param.device))
            if (moved.dtype, moved.device) != kind:
                raise ConfigError(
                    f"{type(model).__name__} is prepared: converting its parameters from {param.dtype} on "
                    f"{param.device} to {moved.dtype} on {moved.device} would detach them from the engine's "
                    "flat buffers, and training would go on with stale copies", key="model",
                    fix="move and cast the model before zerobridge.prepare (model.to(device, dtype)), or choose "
                        "the compute dtype in the spec (precision.param_dtype)")


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
            allow_approximate: bool, replay: Replay | None = None, device: torch.device | None = None
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``spec`` on the native engine: shard ``model`` in place; return it, or ``(model,
    optimizer)`` with the optimizer's parameters replaced by the sharded ones (groups and
    hyperparameters kept). ``replay``: the model is on the meta device and materializes on
    ``device`` with the eager values. Collective."""
    check_fresh(model, optimizer)
    world, local = start_run(model, replay, device)
    plan = plan_engine(spec, model, world_size=world, local_world_size=local, device=device)
    two_hop = plan.wire.grad_reduce is not WireFormat.FULL  # a quantized reduction crosses nodes in two hops
    mesh = build_mesh(shard_size=plan.shard_size, secondary_size=plan.secondary_size,
                      node_size=local if two_hop else 0)
    engine = Engine(model, plan, mesh, device)
    if replay is not None:
        materialize_engine(engine, replay)
        engine.stats.reset()
    adopt_class(model, ZeroModule, "Zero")
    object.__setattr__(model, "_zerobridge_engine", engine)
    set_backend(model, NativeBackend(model, engine))
    apply_compile([u.module for u in engine.units], spec.compile)
    if optimizer is None:
        return model
    replacement = {ref.source_id: new for g in engine.groups for ref, new in zip(g.refs, g.params)}
    for group in optimizer.param_groups:
        group["params"] = [replacement.get(id(p), p) for p in group["params"]]
    engine.stepper.optimizers.add(optimizer)
    return model, optimizer
