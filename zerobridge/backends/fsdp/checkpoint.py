"""Checkpoints of an FSDP2-backed model in zerobridge's format (docs/checkpoints.md).

    zerobridge.save_checkpoint("ckpt/step-100", model, optimizer, metadata={"step": 100})   # backend="fsdp"
    zerobridge.load_checkpoint("ckpt/step-100", model, optimizer)                         # any saving backend

Writing: each rank of the first replica writes its dim-0 shard of every
parameter (under each of its names) and of each optimizer state tensor
shaped like the parameter, as the boxes DCP would write for
``get_state_dict(model, optimizer)``; rank 0 adds buffers, param groups, the
loss scaler, skipped steps, the layout, the metadata, the scheduler's state
and the client state; every rank its RNG states. The native writer's
machinery (``checkpoint/writer.py``) does the atomic save and the manifest.

Reading goes through the verified reader (``checkpoint/reader.py``: files
checked against the manifest, DCP's metadata read with a restricted
unpickler, tensors with ``weights_only``): each rank reads its own rows from
whatever chunks were saved (native runs, FSDP2 shards, a portable file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerobridge._version import __version__
from zerobridge.backends.fsdp.step import FsdpStepper
from zerobridge.checkpoint.layout import ZB, Box, model_key, optim_state_key, param_group_key, rank_key, whole
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
from zerobridge.checkpoint.writer import Blob, Piece, write_checkpoint
from zerobridge.runtime.plan import RunPlan
from zerobridge.runtime.tensors import local_tensor

__all__ = ["FsdpRun", "load_fsdp", "save_fsdp"]


class FsdpRun(Protocol):
    """What saving and loading read of the backend (``backend.py``'s ``FsdpRun``)."""

    model: nn.Module
    mesh: DeviceMesh
    plan: RunPlan
    stepper: FsdpStepper

    @property
    def shard_size(self) -> int: ...


@dataclass(frozen=True)
class Shard:
    """One parameter's rows on this rank."""

    names: tuple[str, ...]
    param: nn.Parameter
    box: Box
    """Rows ``[offset, offset + rows)`` of dim 0, every trailing dim."""

    @property
    def local(self) -> torch.Tensor:
        return _local(self.param)


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``value`` (its DTensor shard), detached: what a checkpoint piece reads."""
    return local_tensor(value).detach()


def _shards(backend: FsdpRun) -> list[Shard]:
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in backend.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    coordinate = backend.mesh.get_coordinate() or [0]
    size, index = backend.shard_size, coordinate[-1]
    out = []
    for pid, param in params.items():
        shape = tuple(param.shape)
        rows_per = math.ceil(shape[0] / size) if shape else 0
        start = min(index * rows_per, shape[0]) if shape else 0
        box = Box((start,) + (0,) * (len(shape) - 1), (min(rows_per, shape[0] - start),) + shape[1:]) if shape \
            else whole(())
        shard = Shard(tuple(names[pid]), param, box)
        assert tuple(shard.local.shape) == box.sizes, f"{names[pid][0]}: FSDP2 shard {tuple(shard.local.shape)}, " \
            f"expected rows {box}"
        out.append(shard)
    return out


def _writer(backend: FsdpRun) -> bool:
    """Ranks of the first replica write (hybrid replicas hold the same shards)."""
    coordinate = backend.mesh.get_coordinate() or [0]
    return backend.mesh.ndim == 1 or coordinate[0] == 0


def layout(backend: FsdpRun) -> dict[str, Any]:
    """How the saving run was laid out (``zerobridge checkpoint info`` prints it)."""
    plan = backend.plan
    return {"world_size": backend.mesh.size(), "shard_size": backend.shard_size,
            "replicas": backend.mesh.size() // backend.shard_size, "strategy": plan.spec.summary(),
            "master_dtype": str(plan.master_dtype).removeprefix("torch."),
            "compute_dtype": str(plan.compute_dtype).removeprefix("torch."), "backend": "fsdp"}


def save_fsdp(path: Path, backend: FsdpRun, optimizer: torch.optim.Optimizer | None, run: RunState) -> Path:
    """``save_checkpoint`` on the FSDP2 backend. Collective."""
    import torch.distributed as dist

    extras = run_blobs(run, distributed=True)
    shards = _shards(backend)
    first = {id(s.param): s.names[0] for s in shards}
    held = _held(optimizer, first)
    pieces: list[Piece] = []
    blobs: list[Blob] = []
    if _writer(backend):
        for shard in shards:
            if not shard.box.numel and shard.box.sizes:
                continue
            shape = tuple(shard.param.shape)
            pieces += [Piece(model_key(n), shard.box, shape, shard.param.dtype, partial(_local, shard.param))
                       for n in shard.names]
            if optimizer is None or id(shard.param) not in held:
                continue
            for key, value in optimizer.state.get(shard.param, {}).items():
                flat = optim_state_key(shard.names[0], key)
                if isinstance(value, DTensor) and tuple(value.shape) == shape:
                    pieces.append(Piece(flat, shard.box, shape, value.dtype, partial(_local, value),
                                        fqn=shard.names[0]))
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    pieces.append(Piece(flat, whole(()), (), value.dtype, partial(_local, value), fqn=shard.names[0]))
                elif isinstance(value, torch.Tensor):
                    raise CheckpointError(f"has shape {tuple(value.shape)}, neither the parameter's {shape} nor a "
                                          "scalar, so it cannot be resharded", key=flat,
                                          fix="use an optimizer whose state is elementwise (AdamW, SGD, ...)")
                else:
                    blobs.append(Blob(flat, value))
    rank = dist.get_rank()
    pieces += [tensor_piece(rank_key(rank, name), value) for name, value in capture_rng().items()]
    summary = layout(backend)
    if rank == 0:
        params = {n for s in shards for n in s.names}
        pieces += [tensor_piece(model_key(n), v) for n, v in backend.model.state_dict().items()
                   if n not in params and isinstance(v, torch.Tensor)]
        if optimizer is not None:
            for i, group in enumerate(optimizer.param_groups):
                blobs += [Blob(param_group_key(i, k), [first[id(p)] for p in v] if k == "params" else v)
                          for k, v in group.items()]
        pieces += [tensor_piece(f"{ZB}.loss_scaler", backend.stepper.scaler.state_tensor()),
                   tensor_piece(f"{ZB}.skipped_steps", torch.tensor(backend.stepper.skipped_steps))]
        blobs += [Blob(LAYOUT_KEY, summary)] + extras
    write_checkpoint(path, pieces, blobs, distributed=True,
                     saved={**summary, "zerobridge": __version__, "torch": torch.__version__})
    return path


def _held(optimizer: torch.optim.Optimizer | None, first: dict[int, str]) -> set[int]:
    return set() if optimizer is None else optimizer_params(optimizer, first)


def _staged(ckpt: Checkpoint, key: str, box: Box, targets: list[Target]) -> torch.Tensor:
    md = ckpt.tensor(key)
    assert md is not None
    buffer = torch.empty(box.sizes, dtype=md.properties.dtype)
    if box.numel:
        targets.append(Target(key, box, buffer))
    return buffer


def load_fsdp(path: Path, backend: FsdpRun, optimizer: torch.optim.Optimizer | None, *, strict: bool,
              rng: bool, with_scheduler: bool = False, verify: bool = True) -> RunState:
    """``load_checkpoint`` on the FSDP2 backend: each rank reads its rows. Collective."""
    import torch.distributed as dist

    ckpt = open_checkpoint(path, distributed=True, verify=verify)
    run = read_run_state(ckpt, with_scheduler=with_scheduler, strict=strict)
    shards = _shards(backend)
    first = {id(s.param): s.names[0] for s in shards}
    params = {n for s in shards for n in s.names}
    buffers = {n: b for n, b in backend.model.state_dict().items() if n not in params and isinstance(b, torch.Tensor)}
    found = check_model(ckpt, [(s.names, tuple(s.param.shape)) for s in shards], buffers, strict)
    keys = {id(s.param): key for s, key in zip(shards, found) if key is not None}
    held = _held(optimizer, first)
    targets: list[Target] = []
    staged = {id(s.param): _staged(ckpt, keys[id(s.param)], s.box, targets) for s in shards if id(s.param) in keys}
    states: dict[int, dict[str, Any]] = {}
    if optimizer is not None:
        if not group_keys(ckpt) and strict:
            raise CheckpointError("holds no optimizer state", source=ckpt.source, key="optim",
                                  fix="pass optimizer=None to load the model only, or strict=False")
        if group_keys(ckpt):
            restore_groups(ckpt, optimizer, first, {s.names[0] for s in shards if not s.param.requires_grad})
        saved = state_keys(ckpt)
        plain_keys = [k for s in shards if id(s.param) in held for k in saved.get(s.names[0], {}).values()
                      if ckpt.is_bytes(k)]
        plain = ckpt.read_bytes(plain_keys) if plain_keys else {}
        for shard in shards:
            if id(shard.param) not in held:
                continue
            state: dict[str, Any] = {}
            for name, key in saved.get(shard.names[0], {}).items():
                md = ckpt.tensor(key)
                if md is None:
                    state[name] = plain[key]
                elif tuple(md.size) == tuple(shard.param.shape) and md.size:
                    state[name] = _staged(ckpt, key, shard.box, targets)
                elif not md.size:
                    state[name] = _staged(ckpt, key, whole(()), targets)
                else:
                    raise CheckpointError(f"has shape {tuple(md.size)}, neither the parameter's "
                                          f"{tuple(shard.param.shape)} nor a scalar", source=ckpt.source, key=key,
                                          fix="only elementwise optimizer state can be resharded")
            states[id(shard.param)] = state
    targets += [Target(model_key(n), whole(tuple(b.shape)), b.data) for n, b in buffers.items()
                if ckpt.tensor(model_key(n)) is not None]
    ckpt.read(targets)
    with torch.no_grad():
        for shard in shards:
            if id(shard.param) in staged:
                shard.local.copy_(staged[id(shard.param)])
    if optimizer is not None:
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for shard in shards:
            if id(shard.param) in states:
                _set_state(optimizer, shard, states[id(shard.param)], group_of[id(shard.param)])
    _restore_stepping(backend, ckpt)
    ranks = saved_ranks(ckpt)
    if rng and ranks:
        source = ranks.get(dist.get_rank() % len(ranks), {})
        restore_rng({name: ckpt.full(key) for name, key in source.items()})
    return run


def _set_state(optimizer: torch.optim.Optimizer, shard: Shard, staged: dict[str, Any], group: dict[str, Any]) -> None:
    """Optimizer state of one parameter: elementwise tensors as DTensors sharded like it."""
    param = shard.param
    if not staged:
        optimizer.state.pop(param, None)  # no state saved: it never had a gradient
        return
    state: dict[str, Any] = {}
    for key, value in staged.items():
        if isinstance(value, torch.Tensor) and value.dim():
            value = state_to_param(key, value, shard.local, group)
            if isinstance(param, DTensor):
                value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
        elif isinstance(value, torch.Tensor):
            value = state_to_param(key, value, shard.local, group)
        state[key] = value
    optimizer.state[param] = state


def _restore_stepping(backend: FsdpRun, ckpt: Checkpoint) -> None:
    """Loss scaler (when both runs scale dynamically) and skipped steps, as the native load does."""
    if ckpt.tensor(f"{ZB}.loss_scaler") is not None:
        backend.stepper.scaler.load_state_tensor(ckpt.full(f"{ZB}.loss_scaler"))
    if ckpt.tensor(f"{ZB}.skipped_steps") is not None:
        backend.stepper.skipped_steps = int(ckpt.full(f"{ZB}.skipped_steps"))
