"""The deepspeed backend: a spec run by real DeepSpeed ZeRO, with the user's own loop.

    model, optimizer = zerobridge.prepare(model, optimizer, stage=2, backend="deepspeed")
    for tokens, targets in data:
        loss = model(tokens, targets)
        loss.backward()
        zerobridge.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()

``prepare`` translates the spec (``config.py``: what DeepSpeed cannot
run exactly is refused unless ``allow_approximate``), calls
``deepspeed.initialize`` with the user's optimizer as its client optimizer
and returns the model itself (its class gains ``DeepSpeedModule``: calls go
through the engine, names stay the user's) and a ``DeepSpeedOptimizer``
whose ``step()`` / ``zero_grad()`` drive the engine (``step.py``).
The optimizer is required: DeepSpeed takes it at initialisation.

Semantics match the native engine: gradients averaged over ranks x
accumulation steps, ``optimizer.step()`` a no-op between accumulation
boundaries, ``clip_grad_norm_`` returns the global norm before clipping.
State is read and written through ``internals.py``; checkpoints are
zerobridge's format (``checkpoint.py``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from zerobridge.backends.base import adopt_class, check_fresh, set_backend, start_run
from zerobridge.backends.deepspeed.backend import DeepSpeedBackend
from zerobridge.backends.deepspeed.config import build_config
from zerobridge.backends.deepspeed.extensions import extensions_dir
from zerobridge.backends.deepspeed.internals import recount_collectives
from zerobridge.backends.deepspeed.materialize import Partitioner, compute_dtype, materialize_deepspeed, restore_masters
from zerobridge.backends.deepspeed.step import DeepSpeedModule
from zerobridge.errors import ConfigError
from zerobridge.runtime import comm_stats
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.deferred_init import Replay
from zerobridge.runtime.plan import hidden_size
from zerobridge.runtime.wrap_units import bucket_sizes
from zerobridge.spec import StrategySpec

__all__ = ["prepare"]


def _groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if stray:
        raise ConfigError(f"the optimizer holds {len(stray)} parameter(s) the model does not own",
                          key="optimizer", fix="build the optimizer from model.parameters()")
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups if len(g["params"]) != 0]


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
            allow_approximate: bool, replay: Replay | None = None, device: torch.device | None = None
            ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``model`` under DeepSpeed as ``spec`` says; return it and the optimizer to step.
    Collective (every rank). ``ConfigError`` for what DeepSpeed cannot run. ``replay``: the
    model is on the meta device and materializes on ``device`` with the eager values, at stage 3
    partitioned as it goes (``materialize.py``)."""
    check_fresh(model, optimizer)
    if optimizer is None:
        section = "optimizer" in spec.passthrough.get("deepspeed", {})
        raise ConfigError("DeepSpeed takes the optimizer when it initialises (its client optimizer): "
                          "prepare(model) alone cannot build the engine", key="optimizer",
                          fix=("the config's optimizer section is built by zerobridge.deepspeed.initialize(model=..., "
                               "config=...), on every backend; or pass your own: " if section else "pass the "
                               "optimizer: ") + "model, optimizer = zerobridge.prepare(model, optimizer, "
                              "backend='deepspeed')")
    groups = _groups(model, optimizer)
    extensions_dir()  # its ops built once per user and torch version; a stale build lock removed
    try:
        import deepspeed  # lazy: an optional dependency, heavy to import
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        raise ConfigError(f"DeepSpeed is not importable ({exc})", key="backend",
                          fix="pip install deepspeed, or use backend='native'") from None

    world, _ = start_run(model, replay, device)
    if world == 1:  # one process without a launcher: DeepSpeed still asks for LOCAL_RANK
        os.environ.setdefault("LOCAL_RANK", "0")
    plan = build_config(spec, world_size=world, allow_approximate=allow_approximate,
                        hidden=hidden_size(model), accelerator=get_accelerator().device_name(),
                        sizes=bucket_sizes(model, spec, world_size=world))
    bf16 = bool(plan.config["bf16"]["enabled"])
    # bf16: DeepSpeed builds its fp32 masters from the bf16 cast; keep the user's values to restore
    # (a meta-built model replays them instead).
    originals = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()
                 if p.requires_grad} if bf16 and replay is None else {}
    comm = CommStats()
    comm_stats.install()  # before DeepSpeed builds anything that could hold a collective
    recount_collectives(deepspeed)
    with comm_stats.counted(comm):
        if replay is not None:
            assert device is not None
            stage3 = plan.config["zero_optimization"]["stage"] == 3
            materialize_deepspeed(model, replay, device, dtype=compute_dtype(plan.config) if stage3 else None,
                                  partitioner=Partitioner(plan.config) if stage3 else None)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=plan.config)
        if spec.compile.enabled:  # DeepSpeed's own path: the module compiled in place (compile_entries)
            engine.compile(backend=spec.compile.backend, compile_kwargs={
                "mode": spec.compile.mode.value, "dynamic": spec.compile.dynamic, "fullgraph": False})
        backend = DeepSpeedBackend(model, engine, optimizer, plan, comm, groups)
        backend.internals.restore_initial(originals)
        if replay is not None and bf16:
            restore_masters(replay, backend.internals)
    comm.reset()
    adopt_class(model, DeepSpeedModule, "DeepSpeed")
    object.__setattr__(model, "_zerobridge_stepper", backend.stepper)
    set_backend(model, backend)
    return model, backend.optimizer
