"""Checkpoints of the native engine: every rank writes its own runs, and reads back whatever its runs overlap.

    >>> import tempfile, torch, zerobridge
    >>> model = zerobridge.prepare(torch.nn.Linear(4, 2), stage=3)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> path = zerobridge.save_checkpoint(tempfile.mkdtemp() + "/ckpt", model, optimizer, metadata={"step": 1})
    >>> zerobridge.load_checkpoint(path, model, optimizer)
    {'step': 1}

Writing, per parameter: each writer run (first replica) becomes boxes of
``model.<name>`` under every name of the parameter, and of each optimizer
state tensor shaped like the parameter (``optim.state.<first name>.<key>``);
0-d state (``step``) is a whole tensor that DCP writes once. Everything is
read through ``zerobridge.engine.local_runs`` when DCP asks for it. Rank 0 adds
buffers, param groups, the loss scaler, skipped steps, the layout, the
metadata, the scheduler's state and the client state; every rank its RNG states.

Reading, on every rank (replicas too): each run's boxes are intersected
with whatever chunks were saved, staged in the saved dtype, and handed to
``write_master`` / ``write_optimizer_state`` a batch of runs at a time;
``refresh_compute`` then rebuilds the compute copies. The format itself is
``zerobridge/checkpoint/``'s; this module only knows where the engine keeps
each run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerobridge._version import __version__
from zerobridge.checkpoint.layout import (
    ZB,
    Box,
    box_start,
    model_key,
    optim_state_key,
    param_group_key,
    rank_key,
    run_boxes,
    whole,
)
from zerobridge.checkpoint.matching import (
    check_model,
    group_keys,
    optimizer_params,
    restore_groups,
    state_keys,
    state_to_param,
)
from zerobridge.checkpoint.metadata import LAYOUT_KEY, read_run_state, run_blobs, saved_ranks, tensor_piece
from zerobridge.checkpoint.reader import Checkpoint, Target, open_checkpoint
from zerobridge.checkpoint.rng import capture_rng, restore_rng
from zerobridge.checkpoint.run_state import RunState
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Blob, Piece, RunCache, write_checkpoint
from zerobridge.engine.engine import Engine
from zerobridge.engine.local_runs import (
    LocalRun,
    local_runs,
    read_master,
    read_optimizer_state,
    refresh_compute,
    write_master,
    write_optimizer_state,
)

__all__ = ["load_native", "save_native"]

STAGING_BYTES = 256 << 20
"""Staged values read before they are handed to the engine (one run at least)."""


def _boxes(run: LocalRun) -> list[Box]:
    shape = tuple(run.shape)
    if math.prod(shape) == 0:
        return [whole(shape)]
    return run_boxes(shape, run.start, run.start + run.numel)


def _cut(load: Callable[[], torch.Tensor], run: LocalRun, box: Box) -> torch.Tensor:
    start = box_start(tuple(run.shape), box) - run.start
    return load().reshape(-1)[start:start + box.numel].view(box.sizes)


def _names(runs: list[LocalRun]) -> dict[int, str]:
    return {id(run.param): run.names[0] for run in runs}


def engine_pieces(engine: Engine, optimizer: torch.optim.Optimizer | None) -> tuple[list[Piece], list[Blob]]:
    """This rank's writes: master values and optimizer state of its writer runs."""
    runs = local_runs(engine)
    cache = RunCache()
    dtype = engine.plan.master_dtype
    pieces: list[Piece] = []
    blobs: list[Blob] = []
    held = optimizer_params(optimizer, _names(runs)) if optimizer is not None else set()
    for run in runs:
        if not run.writer:
            continue
        boxes = _boxes(run)
        master = partial(cache.get, ("master", id(run)), partial(read_master, engine, run))
        for name in run.names:  # a tied weight under each of its names, as get_model_state_dict
            pieces += [Piece(model_key(name), box, tuple(run.shape), dtype, partial(_cut, master, run, box))
                       for box in boxes]
        if optimizer is None or id(run.param) not in held:
            continue
        fqn = run.names[0]
        state = read_optimizer_state(engine, optimizer, run)  # keys and dtypes; values are read again when written
        loader = partial(cache.get, ("optim", id(run)), partial(read_optimizer_state, engine, optimizer, run))
        for key, value in state.items():
            flat = optim_state_key(fqn, key)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == run.param.shape:
                fetch: Callable[[], torch.Tensor] = partial(_state_value, loader, key)
                pieces += [Piece(flat, box, tuple(run.shape), value.dtype, partial(_cut, fetch, run, box), fqn=fqn)
                           for box in boxes]
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                pieces.append(Piece(flat, whole(()), (), value.dtype, partial(_state_value, loader, key), fqn=fqn))
            elif isinstance(value, torch.Tensor):
                raise CheckpointError(f"has shape {tuple(value.shape)}, neither the parameter's "
                                      f"{tuple(run.param.shape)} nor a scalar, so it cannot be resharded",
                                      key=flat, fix="use an optimizer whose state is elementwise (AdamW, SGD, ...)")
            else:
                blobs.append(Blob(flat, value))
    return pieces, blobs


def _state_value(loader: Callable[[], dict[str, Any]], key: str) -> torch.Tensor:
    value: torch.Tensor = loader()[key]
    return value


def replicated_pieces(engine: Engine, optimizer: torch.optim.Optimizer | None,
                      model: nn.Module) -> tuple[list[Piece], list[Blob]]:
    """Rank 0's replicated writes: buffers and the optimizer's param groups."""
    runs = local_runs(engine)
    names = _names(runs)
    params = {name for run in runs for name in run.names}
    pieces = [Piece(model_key(name), whole(tuple(value.shape)), tuple(value.shape), value.dtype,
                    partial(lambda v: v, value))
              for name, value in model.state_dict().items() if name not in params and isinstance(value, torch.Tensor)]
    blobs: list[Blob] = []
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            blobs += [Blob(param_group_key(i, key), [names[id(p)] for p in value] if key == "params" else value)
                      for key, value in group.items()]
    return pieces, blobs


@dataclass
class _Job:
    """One run's reads, and what to do with them once read."""

    targets: list[Target] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    nbytes: int = 0


def _stage(ckpt: Checkpoint, key: str, run: LocalRun, job: _Job) -> torch.Tensor:
    """A flat buffer for ``run`` in the saved dtype, its boxes queued to be read into it."""
    md = ckpt.tensor(key)
    assert md is not None
    buffer = torch.empty(run.numel if math.prod(tuple(run.shape)) else 0, dtype=md.properties.dtype)
    for box in _boxes(run):
        if box.numel:
            start = box_start(tuple(run.shape), box) - run.start
            job.targets.append(Target(key, box, buffer[start:start + box.numel].view(box.sizes)))
    job.nbytes += buffer.numel() * buffer.element_size()
    return buffer


def load_engine(ckpt: Checkpoint, engine: Engine, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                strict: bool) -> None:
    """Read this rank's runs (and buffers) from ``ckpt`` into the engine and the optimizer. Collective."""
    runs = local_runs(engine)
    names = _names(runs)
    params = {name for run in runs for name in run.names}
    buffers = {n: b for n, b in model.state_dict().items() if n not in params and isinstance(b, torch.Tensor)}
    found = check_model(ckpt, [(run.names, tuple(run.shape)) for run in runs], buffers, strict)
    keys = {id(run): key for run, key in zip(runs, found) if key is not None}
    states: dict[str, dict[str, str]] = {}
    held: set[int] = set()
    group_of: dict[int, dict[str, Any]] = {}
    if optimizer is not None:
        held = optimizer_params(optimizer, names)
        states = state_keys(ckpt)
        if not group_keys(ckpt) and strict:
            raise CheckpointError("holds no optimizer state", source=ckpt.source, key="optim",
                                  fix="pass optimizer=None to load the model only, or strict=False")
        if group_keys(ckpt):
            restore_groups(ckpt, optimizer, names, {run.names[0] for run in runs if not run.trainable})
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    byte_keys = [k for run in runs if id(run.param) in held for k in states.get(run.names[0], {}).values()
                 if ckpt.is_bytes(k)]
    plain = ckpt.read_bytes(byte_keys) if byte_keys else {}
    job = _Job()
    for run in runs:
        if id(run) in keys:
            master = _stage(ckpt, keys[id(run)], run, job)
            job.finish.append(partial(write_master, engine, run, master))
        if id(run.param) in held:
            staged: dict[str, Any] = {}
            for name, key in states.get(run.names[0], {}).items():
                md = ckpt.tensor(key)
                if md is None:
                    staged[name] = plain[key]
                elif tuple(md.size) == tuple(run.shape) and md.size:
                    staged[name] = _stage(ckpt, key, run, job)
                elif not md.size:
                    staged[name] = torch.empty((), dtype=md.properties.dtype)
                    job.targets.append(Target(key, whole(()), staged[name]))
                else:
                    raise CheckpointError(f"has shape {tuple(md.size)}, neither the parameter's {tuple(run.shape)} "
                                          "nor a scalar", source=ckpt.source, key=key,
                                          fix="only elementwise optimizer state can be resharded")
            job.finish.append(partial(_set_state, engine, optimizer, run, staged, group_of[id(run.param)]))
        if job.nbytes >= STAGING_BYTES:
            _flush(ckpt, job)
            job = _Job()
    for name, buffer in buffers.items():
        if ckpt.tensor(model_key(name)) is not None:
            job.targets.append(Target(model_key(name), whole(tuple(buffer.shape)), buffer.data))
    _flush(ckpt, job)
    refresh_compute(engine)


def _set_state(engine: Engine, optimizer: torch.optim.Optimizer | None, run: LocalRun, staged: dict[str, Any],
               group: dict[str, Any]) -> None:
    assert optimizer is not None
    if not staged and not read_optimizer_state(engine, optimizer, run):
        return  # no state saved, none now (frozen, or never had a gradient)
    state = {key: state_to_param(key, value.view(run.param.shape) if value.dim() else value, run.param, group)
             if isinstance(value, torch.Tensor) else value for key, value in staged.items()}
    write_optimizer_state(engine, optimizer, run, state)


def _flush(ckpt: Checkpoint, job: _Job) -> None:
    ckpt.read(job.targets)
    for finish in job.finish:
        finish()


def stepping_state(engine: Engine) -> dict[str, torch.Tensor]:
    """Loss scaler ``[scale, hysteresis, clean steps]`` (float64) and skipped steps (int64)."""
    return {"loss_scaler": engine.stepper.scaler.state_tensor(),
            "skipped_steps": torch.tensor(engine.stepper.skipped_steps, dtype=torch.int64)}


def restore_stepping(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    """Put back what ``stepping_state`` saved. A scaler is restored only when both
    runs scale dynamically (a static or absent scale comes from the spec)."""
    if "loss_scaler" in state:
        engine.stepper.scaler.load_state_tensor(state["loss_scaler"])
    if "skipped_steps" in state:
        engine.stepper.skipped_steps = int(state["skipped_steps"])


def layout_summary(engine: Engine) -> dict[str, Any]:
    """How the saving run was laid out (``checkpoint info`` prints it)."""
    plan, mesh = engine.plan, engine.mesh
    return {"world_size": mesh.world_size, "shard_size": mesh.shard_size, "replicas": mesh.replicas,
            "strategy": plan.spec.summary(), "master_dtype": str(plan.master_dtype).removeprefix("torch."),
            "compute_dtype": str(plan.compute_dtype).removeprefix("torch.")}


def save_native(path: Path, model: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer | None,
                run: RunState) -> Path:
    """``save_checkpoint`` on the native engine: every rank its own runs."""
    extras = run_blobs(run, distributed=True)
    pieces, blobs = engine_pieces(engine, optimizer)
    pieces += [tensor_piece(rank_key(engine.mesh.rank, name), value) for name, value in capture_rng().items()]
    layout = layout_summary(engine)
    if engine.mesh.rank == 0:
        more, groups = replicated_pieces(engine, optimizer, model)
        pieces += more + [tensor_piece(f"{ZB}.{name}", value) for name, value in stepping_state(engine).items()]
        blobs += groups + [Blob(LAYOUT_KEY, layout)] + extras
    write_checkpoint(path, pieces, blobs, distributed=True,
                     saved={**layout, "zerobridge": __version__, "torch": torch.__version__})
    return path


def load_native(path: Path, model: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer | None, *,
                strict: bool, rng: bool, with_scheduler: bool = False, verify: bool = True) -> RunState:
    """``load_checkpoint`` on the native engine: each rank reads the chunks its runs overlap."""
    ckpt = open_checkpoint(path, distributed=True, verify=verify)
    run = read_run_state(ckpt, with_scheduler=with_scheduler, strict=strict)
    load_engine(ckpt, engine, model, optimizer, strict=strict)
    extras = {name: ckpt.full(f"{ZB}.{name}") for name in ("loss_scaler", "skipped_steps")
              if ckpt.tensor(f"{ZB}.{name}") is not None}
    restore_stepping(engine, extras)
    ranks = saved_ranks(ckpt)
    if rng and ranks:
        source = ranks.get(engine.mesh.rank % len(ranks), {})
        restore_rng({name: ckpt.full(key) for name, key in source.items()})
    return run
