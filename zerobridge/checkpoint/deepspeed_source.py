"""A zerobridge checkpoint sorted the way DeepSpeed sorts a model, for the DeepSpeed export (``deepspeed_export.py``):
per param group the trainable parameters with Adam state, the frozen ones, the buffers, tied aliases and the one
step count DeepSpeed keeps; what is not Adam's state, or not one step count, is refused with the fix.

    >>> from pathlib import Path
    >>> from zerobridge.checkpoint.deepspeed_source import open_source
    >>> open_source(Path("no/such/ckpt"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    zerobridge.checkpoint.storage.CheckpointError: ...no/such/ckpt: no such checkpoint
      fix: check the path; a save writes a directory there
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerobridge.checkpoint.layout import ZB
from zerobridge.checkpoint.portable import PortableState, portable_from
from zerobridge.checkpoint.reader import Checkpoint, open_checkpoint
from zerobridge.checkpoint.storage import MANIFEST, CheckpointError

__all__ = ["ADAM_STATE", "SortedSource", "open_source", "sort_source"]

ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
"""The per-parameter optimizer state the export writes (Adam's and AdamW's)."""


@dataclass
class SortedSource:
    """A zerobridge checkpoint sorted the way DeepSpeed sorts a model."""

    state: PortableState
    path: Path
    groups: list[list[str]]
    """Trainable parameters (with Adam state) of each param group, in the group's order."""
    frozen: list[str]
    """Parameters DeepSpeed leaves out of its flat groups: frozen (no optimizer state) or empty."""
    buffers: list[str]
    shared: dict[str, str]
    """Tied alias -> the parameter it is (DeepSpeed's ``shared_params``)."""
    step: torch.Tensor
    skipped: int


def open_source(path: Path) -> Checkpoint:
    """The checkpoint at ``path``, or the one a save directory's ``latest`` names (``zerobridge.deepspeed``)."""
    latest = path / "latest"
    if not (path / MANIFEST).exists() and latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        if tag and (path / tag / MANIFEST).is_file():
            path = path / tag
    return open_checkpoint(path)


def sort_source(ckpt: Checkpoint, frozen_names: Iterable[str]) -> SortedSource:
    """``ckpt`` sorted as DeepSpeed sorts the model: per param group its trainable parameters (with Adam state),
    the frozen ones (and ``frozen_names``), the buffers, tied aliases, and the one step count."""
    state = portable_from(ckpt)
    where = str(ckpt.path)
    if not state.param_groups or not state.optimizer:
        raise CheckpointError("holds no optimizer state: a DeepSpeed ZeRO checkpoint is the optimizer's partitions",
                              source=where, key="optim", fix="save the zerobridge checkpoint with its optimizer "
                              "(zerobridge.save_checkpoint(path, model, optimizer))")
    names = [[str(n) for n in group.get("params", [])] for group in state.param_groups]
    listed = {n for group in names for n in group}
    if missing := sorted(n for n in listed if n not in state.model):
        raise CheckpointError(f"optimizer param groups list {missing[:3]}, which the model state lacks", source=where,
                              key="optim.param_groups", fix="restore the checkpoint from a good copy")
    groups: list[list[str]] = []
    frozen: list[str] = []
    for i, group in enumerate(names):
        trainable = [n for n in group if state.optimizer.get(n) and state.model[n].numel() > 0]
        frozen += [n for n in group if n not in trainable]
        groups.append(trainable)
        _check_group(state.param_groups[i], i, where)
    owners = [n for group in names for n in group]
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
    for owner in owners:
        by_shape.setdefault((tuple(state.model[owner].shape), state.model[owner].dtype), []).append(owner)
    wanted = set(frozen_names)
    if unknown := sorted(wanted - set(state.model)):
        raise CheckpointError(f"frozen parameter(s) {unknown[:3]} are not in the checkpoint's model state",
                              source=where, key="frozen", fix="name parameters the checkpoint holds "
                              "(zerobridge checkpoint info lists them)")
    shared: dict[str, str] = {}
    buffers: list[str] = []
    for name, value in state.model.items():
        if name in listed:
            continue
        tied = next((o for o in by_shape.get((tuple(value.shape), value.dtype), [])
                     if value.numel() > 0 and torch.equal(value, state.model[o])), None)
        if tied is not None and name not in wanted:
            shared[name] = tied
        elif name in wanted:
            frozen.append(name)
        else:
            buffers.append(name)
    step = _step([state.optimizer[n] for group in groups for n in group], where)
    skipped = 0
    if ckpt.tensor(f"{ZB}.skipped_steps") is not None:
        skipped = int(ckpt.full(f"{ZB}.skipped_steps").item())
    order = {name: i for i, name in enumerate(state.model)}
    frozen.sort(key=order.__getitem__)
    return SortedSource(state, ckpt.path, groups, frozen, buffers, shared, step, skipped)


def _check_group(group: dict[str, Any], index: int, where: str) -> None:
    """Adam's hyperparameters, without the variants DeepSpeed's FusedAdam does not run."""
    if missing := [k for k in ("lr", "betas", "eps", "weight_decay") if k not in group]:
        raise CheckpointError(f"param group {index} has no {missing}: not an Adam/AdamW optimizer's state",
                              source=where, key=f"optim.param_groups.{index}",
                              fix="only Adam and AdamW state is written; resume under zerobridge instead")
    for flag in ("amsgrad", "maximize"):
        if group.get(flag) is True:
            raise CheckpointError(f"param group {index} runs Adam with {flag}=True, which DeepSpeed's FusedAdam "
                                  "does not", source=where, key=f"optim.param_groups.{index}.{flag}",
                                  fix="export only Adam/AdamW state without amsgrad or maximize")


def _step(states: list[dict[str, torch.Tensor]], where: str) -> torch.Tensor:
    """The one step count of every trainable parameter (DeepSpeed keeps one per flat group)."""
    for state in states:
        if extra := sorted(set(state) - set(ADAM_STATE)):
            raise CheckpointError(f"optimizer state holds {extra}: not Adam's (exp_avg, exp_avg_sq, step)",
                                  source=where, key="optim.state",
                                  fix="only Adam and AdamW state is written; resume under zerobridge instead")
        if absent := [k for k in ADAM_STATE if k not in state]:
            raise CheckpointError(f"optimizer state lacks {absent}", source=where, key="optim.state",
                                  fix="restore the checkpoint from a good copy")
    steps = {float(s["step"]) for s in states}
    if len(steps) != 1:
        raise CheckpointError(f"parameters were stepped different numbers of times {sorted(steps)}; DeepSpeed keeps "
                              "one step count per flat group", source=where, key="optim.state.step",
                              fix="export a checkpoint in which every trainable parameter has been stepped as often")
    return states[0]["step"].detach().clone()
