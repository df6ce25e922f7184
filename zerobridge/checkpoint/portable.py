"""A checkpoint held whole in one process: full tensors under their names.

    >>> import tempfile, pathlib, torch
    >>> from zerobridge.checkpoint.portable import PortableState, read_portable, write_portable
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> state = PortableState(model={"w": torch.ones(2, 3)}, optimizer={"w": {"step": torch.tensor(4.0)}},
    ...                       param_groups=[{"lr": 0.1, "params": ["w"]}], metadata={"step": 4})
    >>> _ = write_portable(path, state)
    >>> back = read_portable(path)
    >>> back.model["w"].shape, back.optimizer["w"]["step"].item(), back.param_groups, back.metadata
    (torch.Size([2, 3]), 4.0, [{'lr': 0.1, 'params': ['w']}], {'step': 4})

``PortableState`` is what a reader of another format (DeepSpeed ZeRO, a
consolidated file) produces and what ``write_portable`` turns into a
zerobridge checkpoint that any stage and world size can load; the same keys
as a sharded save, each tensor one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerobridge.checkpoint.layout import model_key, optim_state_key, param_group_key, whole
from zerobridge.checkpoint.matching import group_keys, state_keys
from zerobridge.checkpoint.metadata import LAYOUT_KEY, read_run_state, run_blobs
from zerobridge.checkpoint.reader import Checkpoint, open_checkpoint
from zerobridge.checkpoint.run_state import RunState
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Blob, Piece, write_checkpoint

__all__ = ["PortableState", "portable_from", "read_portable", "write_portable"]


@dataclass
class PortableState:
    """Full (unsharded) model and optimizer state of one training run."""

    model: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter and buffer values by fully qualified name (``"h.0.attn.weight"``)."""
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Optimizer state by parameter name, then state key (``"exp_avg"``, ``"step"``)."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Optimizer groups in order: hyperparameters plus ``"params"``, a list of parameter names."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-able user metadata (``{"step": 10}``)."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's ``state_dict()`` (torch's, or DeepSpeed's ``{"last_batch_iteration": n}``)."""
    client_state: dict[str, Any] | None = None
    """Plain values ``load_checkpoint`` returns under ``"client_state"`` (DeepSpeed's ``client_state``)."""


def write_portable(path: str | Path, state: PortableState, *, extras: dict[str, torch.Tensor] | None = None,
                   layout: dict[str, Any] | None = None) -> Path:
    """Write ``state`` as a zerobridge checkpoint (one process, no process group),
    loadable by ``load_checkpoint`` at any stage and world size, and by FSDP2.

    Optimizer state is keyed by parameter name; ``param_groups[i]["params"]``
    lists names. ``metadata`` must be JSON-able; it is what ``load_checkpoint``
    returns, with ``client_state`` under ``"client_state"``; ``scheduler`` is
    what ``load_checkpoint(scheduler=...)`` restores. ``extras``: more whole tensors under their full keys (zerobridge's
    own, e.g. ``zerobridge.rng.<rank>.torch``, ``zerobridge.skipped_steps``);
    ``layout``: what ``checkpoint info`` reports as the saving layout. Written
    to a temporary sibling and swapped into place."""
    pieces = [_piece(model_key(name), value) for name, value in state.model.items()]
    pieces += [_piece(key, value) for key, value in (extras or {}).items()]
    for fqn, entries in state.optimizer.items():
        pieces += [_piece(optim_state_key(fqn, key), value, fqn) for key, value in entries.items()]
    blobs = [Blob(param_group_key(i, key), list(value) if key == "params" else value)
             for i, group in enumerate(state.param_groups) for key, value in group.items()]
    if layout is None:
        layout = {"world_size": 1, "shard_size": 1, "replicas": 1, "strategy": "portable (whole tensors)"}
        source = state.metadata.get("source")
        if isinstance(source, str):
            layout["strategy"] = f"portable, from {source}"
    blobs += [Blob(LAYOUT_KEY, layout)]
    blobs += run_blobs(RunState(metadata=state.metadata, scheduler=state.scheduler, client_state=state.client_state),
                       distributed=False)
    write_checkpoint(Path(path), pieces, blobs, saved=layout, distributed=False)
    return Path(path)


def _piece(key: str, value: torch.Tensor, fqn: str | None = None) -> Piece:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"is a {type(value).__name__}, not a tensor", key=key,
                              fix="PortableState holds tensors only (0-d for scalars such as step)")
    shape = tuple(value.shape)
    return Piece(key, whole(shape), shape, value.dtype, lambda: value, fqn=fqn)


def read_portable(path: str | Path, *, optimizer: bool = True) -> PortableState:
    """Every tensor of a checkpoint, whole, in this process (any layout wrote it,
    FSDP2 included). ``optimizer=False`` reads the model weights only."""
    return portable_from(open_checkpoint(path), optimizer=optimizer)


def portable_from(ckpt: Checkpoint, *, optimizer: bool = True) -> PortableState:
    """``read_portable`` on a checkpoint already opened (and verified)."""
    run = read_run_state(ckpt, with_scheduler=False, strict=False)
    state = PortableState(metadata=run.metadata, scheduler=run.scheduler, client_state=run.client_state)
    state.model = {key[len("model."):]: ckpt.full(key) for key in ckpt
                   if key.startswith("model.") and ckpt.tensor(key) is not None}
    if not optimizer:
        return state
    for fqn, entries in state_keys(ckpt).items():
        tensors = {name: ckpt.full(key) for name, key in entries.items() if ckpt.tensor(key) is not None}
        if tensors:
            state.optimizer[fqn] = tensors
    groups = group_keys(ckpt)
    values = ckpt.read_bytes([key for group in groups.values() for key in group.values()])
    state.param_groups = [{name: values[key] for name, key in groups[i].items()} for i in sorted(groups)]
    return state
