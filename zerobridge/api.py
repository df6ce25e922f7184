"""The public API: prepare a model, clip, read full state, measure.

    >>> import torch, zerobridge
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> model = zerobridge.prepare(model, stage=3)         # world size 1 under plain python
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> model(torch.randn(4, 8)).pow(2).mean().backward()
    >>> norm = zerobridge.clip_grad_norm_(model, 1.0)
    >>> optimizer.step(); optimizer.zero_grad()
    >>> sorted(zerobridge.full_state_dict(model))
    ['0.bias', '0.weight', '2.bias', '2.weight']

Launch on several ranks with ``zerobridge run --nproc 4 --stage 3 train.py``
or plain ``torchrun``. With no strategy argument, ``ZEROBRIDGE_CONFIG`` in the
environment chooses one; with neither, stage 0 (plain data parallel).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.distributed import init_distributed
from zerobridge.engine import Engine, plan_engine
from zerobridge.runtime.compile import apply_compile, check_compile, is_compiled_wrapper, unwrap_compiled
from zerobridge.engine.materialize import materialize_engine
from zerobridge.engine.mesh import build_mesh
from zerobridge.env import choice_from_env, resolve_allow_approximate, resolve_backend, resolve_compile
from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.runtime.deferred_init import Replay, is_meta_model, materialize_device, replay_on_every_rank
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage

__all__ = ["ZeroModule", "clip_grad_norm_", "full_state_dict", "init_distributed", "prepare", "refuse_moving", "reset_stats",
           "spec_for_stage", "stats"]

InitFn = Callable[[nn.Module], object]


class ZeroModule(nn.Module):
    """Mixed into a prepared model's class: the model keeps its own class and names."""

    _zerobridge_engine: Engine

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication: accumulate locally until a backward outside."""
        with self._zerobridge_engine.no_sync():
            yield

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


_CLASSES: dict[type, type] = {}


def resolve_spec(model: nn.Module, *, stage: int | None, strategy: str | None,
                 config: str | Path | dict[str, Any] | StrategySpec | None) -> StrategySpec:
    """The spec the arguments (or ``ZEROBRIDGE_CONFIG``) name."""
    given = [name for name, value in (("stage", stage), ("strategy", strategy), ("config", config)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"prepare() got {' and '.join(given)}: name the strategy once",
                          key=given[1], fix=f"pass only {given[0]}=")
    if stage is not None:
        return spec_for_stage(stage, model)
    if strategy is not None:
        return load_spec(strategy).value
    if config is not None:
        return load_spec(config).value
    chosen = choice_from_env()
    if chosen is None:
        return spec_for_stage(0, model)
    kind, choice = chosen
    if kind == "stage":
        return spec_for_stage(int(choice), model)
    return load_spec(str(choice)).value


def _check_model(model: nn.Module) -> None:
    from zerobridge.backends import is_prepared

    if isinstance(model, ZeroModule) or is_prepared(model):
        raise ConfigError(f"{type(model).__name__} is already prepared", key="model",
                          fix="call zerobridge.prepare once per model")
    params = list(model.parameters())
    if not params:
        raise ConfigError(f"{type(model).__name__} has no parameters to shard", key="model",
                          fix="pass the module that owns the parameters")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ConfigError(f"parameters on several devices: {sorted(map(str, devices))}", key="model",
                          fix="move the model to one device before prepare (model.to(device))")


@overload
def prepare(model: nn.Module, optimizer: None = None, *, stage: int | None = None, strategy: str | None = None,
            config: str | Path | dict[str, Any] | StrategySpec | None = None, backend: str | None = None,
            allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None) -> nn.Module: ...
@overload
def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int | None = None,
            strategy: str | None = None, config: str | Path | dict[str, Any] | StrategySpec | None = None,
            backend: str | None = None, allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None
            ) -> tuple[nn.Module, torch.optim.Optimizer]: ...


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, stage: int | None = None,
            strategy: str | None = None, config: str | Path | dict[str, Any] | StrategySpec | None = None,
            backend: str | None = None, allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Shard ``model`` (in place) as the strategy says; return it, or ``(model, optimizer)``.

    ``optimizer``: one built before on the original parameters; its param
    groups and hyperparameters are kept, its parameters replaced by the
    sharded ones. It must not have stepped yet.

    ``backend``: ``"native"`` (zerobridge's engine), ``"fsdp"`` (torch
    FSDP2) or ``"deepspeed"``; ``None``: ``$ZEROBRIDGE_BACKEND``, else
    native. ``allow_approximate``: run what a backend cannot express exactly
    as its closest equivalent (recorded) instead of refusing; ``None``:
    ``$ZEROBRIDGE_ALLOW_APPROXIMATE`` (``zerobridge run --allow-approximate``), else False.

    A model built under ``torch.device("meta")`` is materialized here, one
    module at a time, with the values an eager build from the same seed would
    have had (docs/big-models.md). ``init_fn(module)``: called on every module,
    children first, instead of its own ``reset_parameters()`` /
    ``_init_weights``. ``device``: where a meta model materializes (default:
    ``cuda:$LOCAL_RANK`` when CUDA is available, else the CPU).

    ``compile``: run the model's units under ``torch.compile`` as the spec's
    ``compile`` section says (``True``/``False`` override its ``enabled``;
    ``None``: ``$ZEROBRIDGE_COMPILE``, set by ``zerobridge run --compile``,
    else the spec). A model ``torch.compile`` returned may be passed too: the
    module inside is sharded and the compiled wrapper returned (docs/compile.md).
    """
    chosen = resolve_backend(backend)
    approximate = resolve_allow_approximate(allow_approximate)
    compiling = resolve_compile(compile)
    wrapper, model = model, unwrap_compiled(model)
    meta = is_meta_model(model)  # first: a partly-meta model is named as such
    _check_model(model)
    replay = Replay(model, init_fn) if meta else None
    if replay is None and init_fn is not None:
        raise ConfigError("init_fn is given but the model is not on the meta device", key="init_fn",
                          fix="build the model under `with torch.device('meta'):`, or initialize it yourself")
    target = materialize_device(device) if replay is not None else None
    spec = _with_compile(resolve_spec(model, stage=stage, strategy=strategy, config=config), compiling,
                         wrapped=wrapper is not model)
    if chosen != "native":
        prepared = _prepare_other(chosen, model, optimizer, spec, allow_approximate=approximate, replay=replay,
                                  device=target)
        return _rewrap(prepared, wrapper)
    if optimizer is not None and any(optimizer.state.values()):
        raise ConfigError("the optimizer has already stepped (it holds state)", key="optimizer",
                          fix="call zerobridge.prepare before the first optimizer.step()")
    init_distributed(model, target)
    if replay is not None:
        assert target is not None
        replay_on_every_rank(replay, target)
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = plan_engine(spec, model, world_size=world, local_world_size=local, device=target)
    mesh = build_mesh(shard_size=plan.shard_size, secondary_size=plan.secondary_size)
    engine = Engine(model, plan, mesh, target)
    if replay is not None:
        materialize_engine(engine, replay)
        engine.stats.reset()
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Zero{cls.__name__}", (ZeroModule, cls), {"__module__": cls.__module__})
    model.__class__ = _CLASSES[cls]
    object.__setattr__(model, "_zerobridge_engine", engine)
    from zerobridge.backends import attach
    from zerobridge.backends.native import NativeBackend

    attach(model, NativeBackend(model, engine))
    apply_compile([u.module for u in engine.units], spec.compile)
    if optimizer is None:
        return wrapper
    replacement = {ref.source_id: new for g in engine.groups for ref, new in zip(g.refs, g.params)}
    for group in optimizer.param_groups:
        group["params"] = [replacement.get(id(p), p) for p in group["params"]]
    engine.stepping.optimizers.add(optimizer)
    return wrapper, optimizer


def _with_compile(spec: StrategySpec, compiling: bool | None, *, wrapped: bool) -> StrategySpec:
    """The spec with ``compile.enabled`` as the caller decided; a model compiled before
    ``prepare`` is not compiled again."""
    if compiling is not None and compiling != spec.compile.enabled:
        spec = spec.model_copy(update={"compile": spec.compile.model_copy(update={"enabled": compiling})})
    if wrapped and spec.compile.enabled:
        raise ConfigError("the model was compiled before prepare (torch.compile returned it) and the spec "
                          "compiles it again", key="compile.enabled",
                          fix="compile once: pass the uncompiled model, or prepare(..., compile=False)")
    check_compile(spec.compile)
    return spec


def _rewrap(prepared: nn.Module | tuple[nn.Module, torch.optim.Optimizer], wrapper: nn.Module
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """What another backend prepared (in place), returned through the user's compiled wrapper
    if there was one."""
    if not is_compiled_wrapper(wrapper):
        return prepared
    return (wrapper, prepared[1]) if isinstance(prepared, tuple) else wrapper


def _prepare_other(name: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
                   allow_approximate: bool, replay: Replay | None, device: torch.device | None
                   ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``spec`` on torch FSDP2 or DeepSpeed (``zerobridge/backends/``)."""
    import importlib

    module = importlib.import_module(f"zerobridge.backends.{name}")
    if replay is None:
        prepared: nn.Module | tuple[nn.Module, torch.optim.Optimizer] = module.prepare(
            model, optimizer, spec, allow_approximate=allow_approximate)
    else:
        prepared = module.prepare(model, optimizer, spec, allow_approximate=allow_approximate, replay=replay,
                                  device=device)
    return prepared


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over every rank and shard; return the norm."""
    from zerobridge.backends import backend_of

    return backend_of(model).clip_grad_norm(float(max_norm), float(norm_type))


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
                    ) -> dict[str, torch.Tensor]:
    """The unsharded state dict under the original names (tied ones under each). Collective.

    ``rank0_only``: only rank 0 gets it (the others ``{}``); ``offload_to_cpu``:
    values in host memory. With both, the native engine gathers one group at
    a time to rank 0's host memory: no rank holds the whole model on its device."""
    from zerobridge.backends import backend_of

    return backend_of(model).full_state(rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)


def stats(model: nn.Module) -> dict[str, Any]:
    """This rank's model-state bytes and communication since the last reset.

    ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (master plus optimizer
    state): bytes in memory. ``tier_bytes``: all of them by where they live,
    ``device`` (tier none, also on a CPU machine), ``host`` (tier cpu, and the
    small state kept in memory by the nvme tier) and ``nvme`` (swap files).
    ``comm_bytes`` / ``comm_calls``: per collective kind since the last
    ``reset_stats``. ``loss_scale``, ``skipped_steps``: fp16 loss scaling.
    """
    from zerobridge.backends import backend_of

    return backend_of(model).stats()


def reset_stats(model: nn.Module) -> None:
    """Start counting communication from zero."""
    from zerobridge.backends import backend_of

    backend_of(model).reset_stats()
