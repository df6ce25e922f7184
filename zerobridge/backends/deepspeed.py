"""The deepspeed backend: a spec run by real DeepSpeed ZeRO, with the user's own loop.

    model, optimizer = zerobridge.prepare(model, optimizer, stage=2, backend="deepspeed")
    for tokens, targets in data:
        loss = model(tokens, targets)
        loss.backward()
        zerobridge.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()

``prepare`` translates the spec (``deepspeed_config``: what DeepSpeed cannot
run exactly is refused unless ``allow_approximate``), calls
``deepspeed.initialize`` with the user's optimizer as its client optimizer
and returns the model itself (its class gains ``DeepSpeedModule``: calls go
through the engine, names stay the user's) and a ``DeepSpeedOptimizer``
whose ``step()`` / ``zero_grad()`` drive the engine (``deepspeed_loop``).
The optimizer is required: DeepSpeed takes it at initialisation.

Semantics match the native engine: gradients averaged over ranks x
accumulation steps, ``optimizer.step()`` a no-op between accumulation
boundaries, ``clip_grad_norm_`` returns the global norm before clipping.
State is read and written through ``deepspeed_access``; checkpoints are
zerobridge's format (``deepspeed_checkpoint``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.runtime import comm_stats
from zerobridge.backends.base import Backend, attach, is_prepared
from zerobridge.backends.deepspeed_access import Access, held_bytes
from zerobridge.backends.deepspeed_config import DeepSpeedPlan, build_config
from zerobridge.backends.deepspeed_loop import DeepSpeedModule, DeepSpeedOptimizer, DeepSpeedStepper
from zerobridge.backends.deepspeed_materialize import Partitioner, compute_dtype, materialize_deepspeed, restore_masters
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.errors import ConfigError
from zerobridge.distributed import init_distributed
from zerobridge.runtime.deferred_init import Replay, replay_on_every_rank
from zerobridge.runtime.plan import hidden_size
from zerobridge.spec import StrategySpec

__all__ = ["DeepSpeedBackend", "DeepSpeedModule", "DeepSpeedOptimizer", "prepare"]

_CLASSES: dict[type, type] = {}


class DeepSpeedBackend(Backend):
    """A model run by a ``deepspeed.DeepSpeedEngine``."""

    name: ClassVar[str] = "deepspeed"

    def __init__(self, model: nn.Module, engine: Any, client: torch.optim.Optimizer, plan: DeepSpeedPlan,
                 comm: CommStats, groups: list[list[str]]) -> None:
        self.model = model
        self.engine = engine
        self.client = client
        self.plan = plan
        self.report = plan.report
        """The translator's report: what each spec key became in DeepSpeed's config."""
        self.comm = comm
        self.groups = groups
        """Names of the parameters of each param group the client optimizer had (empty groups dropped,
        as DeepSpeed drops them)."""
        self.access = Access(engine, model, client)
        self.stepper = DeepSpeedStepper(engine, model, self.access, comm, accumulation_steps=plan.accumulation_steps,
                         clip=plan.clip)
        self.optimizer = DeepSpeedOptimizer(self.stepper, client)
        zero = plan.config["zero_optimization"]
        self.offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") != "none"
        self.offload_params = zero.get("offload_param", {}).get("device", "none") != "none"

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.stepper.clip_grad_norm(max_norm, norm_type)

    def named_params(self) -> list[tuple[nn.Parameter, list[str]]]:
        """Each parameter once, with all its names (a tied weight has several)."""
        found: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            found.setdefault(id(param), (param, []))[1].append(name)
        return list(found.values())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        with self.stepper.counting():
            for param, names in self.named_params():
                value = self.access.full_master(param)
                for name in names:
                    state[name] = value
        return state

    def stats(self) -> dict[str, Any]:
        scale = getattr(self.engine.optimizer, "loss_scale", 1.0)
        return {**held_bytes(self.access, offload_optimizer=self.offload_optimizer,
                             offload_params=self.offload_params),
                "comm_bytes": dict(self.comm.bytes), "comm_calls": dict(self.comm.calls),
                "loss_scale": float(scale), "skipped_steps": int(self.engine.skipped_steps),
                "approximations": [{"key": e.key, "status": e.status.value, "note": e.note}
                                   for e in self.plan.approximations]}

    def reset_stats(self) -> None:
        self.comm.reset()

    def _check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None and optimizer is not self.optimizer and optimizer is not self.client:
            raise ConfigError("this optimizer is not the one zerobridge.prepare returned for the model",
                              key="optimizer", fix="pass the optimizer prepare returned")

    def save_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None,
                        metadata: dict[str, Any] | None) -> Path:
        from zerobridge.backends.deepspeed_checkpoint import save

        self._check_optimizer(optimizer)
        with self.stepper.counting():
            return save(self, path, with_optimizer=optimizer is not None, metadata=metadata)

    def load_checkpoint(self, path: Path, optimizer: torch.optim.Optimizer | None, *, strict: bool,
                        rng: bool) -> dict[str, Any]:
        from zerobridge.backends.deepspeed_checkpoint import load

        self._check_optimizer(optimizer)
        with self.stepper.counting():
            return load(self, path, with_optimizer=optimizer is not None, strict=strict, rng=rng)


def _groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if stray:
        raise ConfigError(f"the optimizer holds {len(stray)} parameter(s) the model does not own",
                          key="optimizer", fix="build the optimizer from model.parameters()")
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups if len(g["params"]) != 0]


def _recount(deepspeed: Any) -> None:
    """DeepSpeed's torch comm backend keeps the all-gather and reduce-scatter functions it found
    when it was built; one built before ``counting.install`` would hold uncounted ones."""
    backend = getattr(deepspeed.comm.comm, "cdb", None)
    if backend is not None and hasattr(backend, "get_all_gather_function"):
        backend.all_gather_function = backend.get_all_gather_function()
        backend.reduce_scatter_function = backend.get_reduce_scatter_function()


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: StrategySpec, *,
            allow_approximate: bool, replay: Replay | None = None, device: torch.device | None = None
            ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Run ``model`` under DeepSpeed as ``spec`` says; return it and the optimizer to step.
    Collective (every rank). ``ConfigError`` for what DeepSpeed cannot run. ``replay``: the
    model is on the meta device and materializes on ``device`` with the eager values, at stage 3
    partitioned as it goes (``deepspeed_materialize``)."""
    if is_prepared(model):
        raise ConfigError(f"{type(model).__name__} is already prepared", key="model",
                          fix="call zerobridge.prepare once per model")
    if optimizer is None:
        raise ConfigError("DeepSpeed takes the optimizer when it initialises (its client optimizer): "
                          "prepare(model) alone cannot build the engine", key="optimizer",
                          fix="pass the optimizer: model, optimizer = zerobridge.prepare(model, optimizer, "
                              "backend='deepspeed')")
    if any(optimizer.state.values()):
        raise ConfigError("the optimizer has already stepped (it holds state)", key="optimizer",
                          fix="call zerobridge.prepare before the first optimizer.step()")
    groups = _groups(model, optimizer)
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:
        raise ConfigError(f"DeepSpeed is not importable ({exc})", key="backend",
                          fix="pip install deepspeed, or use backend='native'") from None

    init_distributed(model, device)
    if dist.get_world_size() == 1:  # one process without a launcher: DeepSpeed still asks for LOCAL_RANK
        os.environ.setdefault("LOCAL_RANK", "0")
    if replay is not None:
        assert device is not None, "a meta-device model names the device it materializes on"
        replay_on_every_rank(replay, device)
    plan = build_config(spec, world_size=dist.get_world_size(), allow_approximate=allow_approximate,
                        hidden=hidden_size(model), accelerator=get_accelerator().device_name())
    bf16 = bool(plan.config["bf16"]["enabled"])
    # bf16: DeepSpeed builds its fp32 masters from the bf16 cast; keep the user's values to restore
    # (a meta-built model replays them instead).
    originals = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()
                 if p.requires_grad} if bf16 and replay is None else {}
    comm = CommStats()
    comm_stats.install()  # before DeepSpeed builds anything that could hold a collective
    _recount(deepspeed)
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
        backend.access.restore_initial(originals)
        if replay is not None and bf16:
            restore_masters(replay, backend.access)
    comm.reset()
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"DeepSpeed{cls.__name__}", (DeepSpeedModule, cls), {"__module__": cls.__module__})
    model.__class__ = _CLASSES[cls]
    object.__setattr__(model, "_zerobridge_stepper", backend.stepper)
    attach(model, backend)
    return model, backend.optimizer
