"""An engine rank's part of a checkpoint: its runs as boxes to write, and what it reads back.

Writing, per parameter: each writer run (first replica) becomes boxes of
``model.<name>`` under every name of the parameter, and of each optimizer
state tensor shaped like the parameter (``optim.state.<first name>.<key>``);
0-d state (``step``) is a whole tensor that DCP writes once. Everything is
read through ``zerobridge.engine.access`` when DCP asks for it.

Reading, on every rank (replicas too): each run's boxes are intersected
with whatever chunks were saved, staged in the saved dtype, and handed to
``write_master`` / ``write_optimizer_state`` a batch of runs at a time;
``refresh_compute`` then rebuilds the compute copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerobridge.checkpoint.layout import Box, box_start, model_key, optim_state_key, param_group_key, run_boxes, whole
from zerobridge.checkpoint.reader import Checkpoint, Target
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Blob, Piece, RunCache
from zerobridge.engine.access import (
    LocalRun, local_runs, read_master, read_optimizer_state, refresh_compute, write_master, write_optimizer_state,
)

if TYPE_CHECKING:
    from zerobridge.engine.engine import Engine

__all__ = ["check_model", "engine_pieces", "load_engine", "optimizer_params", "replicated_pieces", "restore_groups",
           "state_to_param"]

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


def optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> set[int]:
    """``id()`` of every parameter ``optimizer`` holds; an error if one is not in ``names`` (the model's)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held - set(names):
        raise CheckpointError(f"the optimizer holds {len(held - set(names))} parameter(s) the prepared model does "
                              "not own", key="optimizer",
                              fix="build the optimizer from model.parameters() after zerobridge.prepare")
    return held


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


def state_keys(ckpt: Checkpoint) -> dict[str, dict[str, str]]:
    """``{fqn: {state key: checkpoint key}}`` from the recorded paths (or the keys' last dot)."""
    found: dict[str, dict[str, str]] = {}
    for key in ckpt.keys():
        path = ckpt.paths.get(key)
        if path is not None and len(path) == 4 and path[:2] == ("optim", "state"):
            found.setdefault(str(path[2]), {})[str(path[3])] = key
        elif path is None and key.startswith("optim.state."):
            fqn, _, state_key = key[len("optim.state."):].rpartition(".")
            found.setdefault(fqn, {})[state_key] = key
    return found


def group_keys(ckpt: Checkpoint) -> dict[int, dict[str, str]]:
    """``{group index: {hyperparameter: checkpoint key}}``."""
    found: dict[int, dict[str, str]] = {}
    for key in ckpt.keys():
        path = ckpt.paths.get(key)
        parts = key.split(".", 3)
        if path is None and key.startswith("optim.param_groups.") and len(parts) == 4 and parts[2].isdigit():
            path = ("optim", "param_groups", int(parts[2]), parts[3])
        if path is not None and len(path) == 4 and path[:2] == ("optim", "param_groups") and isinstance(path[2], int):
            found.setdefault(path[2], {})[str(path[3])] = key
    return found


def restore_groups(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, names: dict[int, str],
                    frozen: set[str]) -> None:
    """Hyperparameters back into the optimizer's groups, matched by position; each group
    must hold the same trainable parameters (frozen ones never step, and some writers,
    DeepSpeed among them, leave them out of the groups)."""
    saved = group_keys(ckpt)
    if sorted(saved) != list(range(len(optimizer.param_groups))):
        raise CheckpointError(f"holds {len(saved)} optimizer param group(s); this optimizer has "
                              f"{len(optimizer.param_groups)}", source=ckpt.source, key="optim.param_groups",
                              fix="build the optimizer's param groups as the saving run did (or pass optimizer=None)")
    values = ckpt.read_bytes([key for group in saved.values() for key in group.values()])
    for i, group in enumerate(optimizer.param_groups):
        current = {names[id(p)] for p in group["params"]} - frozen
        if "params" in saved[i] and set(values[saved[i]["params"]]) - frozen != current:
            theirs = set(values[saved[i]["params"]]) - frozen
            raise CheckpointError(f"group {i} holds {sorted(theirs - current)[:3]} that this optimizer's group {i} "
                                  f"lacks, and lacks {sorted(current - theirs)[:3]}", source=ckpt.source,
                                  key=param_group_key(i, "params"),
                                  fix="put the same parameters in each group as the saving run did")
        for name, key in saved[i].items():
            if name != "params":
                group[name] = values[key]


def state_to_param(key: str, value: torch.Tensor, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Place a state tensor as torch's ``Optimizer.load_state_dict`` does."""
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def check_model(ckpt: Checkpoint, params: list[tuple[tuple[str, ...], tuple[int, ...]]],
                buffers: dict[str, torch.Tensor], strict: bool) -> list[str | None]:
    """The checkpoint key of each parameter, given as (names, whole shape), or ``None`` where
    the checkpoint lacks it; a clear error for shape mismatches and, strictly, for missing or
    unexpected names. Shared by every backend's loader."""
    found: list[str | None] = []
    missing = []
    for names, shape in params:
        key = next((model_key(n) for n in names if ckpt.tensor(model_key(n)) is not None), None)
        found.append(key)
        if key is None:
            missing.append(names[0])
            continue
        saved = tuple(ckpt.tensor(key).size)  # type: ignore[union-attr]
        if saved != tuple(shape):
            raise CheckpointError(f"has shape {saved}; the model's parameter has {tuple(shape)}",
                                  source=ckpt.source, key=key, fix="load into the model architecture that saved it")
    for name, buffer in buffers.items():
        md = ckpt.tensor(model_key(name))
        if md is None:
            missing.append(name)
        elif tuple(md.size) != tuple(buffer.shape):
            raise CheckpointError(f"has shape {tuple(md.size)}; the model's buffer has {tuple(buffer.shape)}",
                                  source=ckpt.source, key=model_key(name),
                                  fix="load into the model architecture that saved it")
    known = {model_key(n) for names, _ in params for n in names} | {model_key(n) for n in buffers}
    unexpected = sorted(k for k in ckpt.keys() if k.startswith("model.") and k not in known)
    if strict and (missing or unexpected):
        parts = ([f"missing {len(missing)}: {', '.join(missing[:5])}"] if missing else []) + \
                ([f"unexpected {len(unexpected)}: {', '.join(unexpected[:5])}"] if unexpected else [])
        raise CheckpointError(f"does not match the model ({'; '.join(parts)})", source=ckpt.source, key="model",
                              fix="load into the model that saved it, or pass strict=False to load what matches")
    return found


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
