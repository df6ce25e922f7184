"""Save and resume training: sharded checkpoints, and consolidated weights.

    import zerobridge

    model = zerobridge.prepare(model, stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ...
    zerobridge.save_checkpoint("ckpt/step-100", model, optimizer, metadata={"step": 100})   # every rank
    zerobridge.save_full("model.safetensors", model, dtype=torch.bfloat16)                  # every rank

    # later, at any stage, world size or hybrid layout:
    meta = zerobridge.load_checkpoint("ckpt/step-100", model, optimizer)                   # {"step": 100}

All three are collective: every rank calls them. The format, keys and
guarantees are in docs/checkpoints.md.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zerobridge._version import __version__
from zerobridge.checkpoint.extras import capture_rng, layout_summary, restore_rng, restore_stepping, stepping_state
from zerobridge.checkpoint.full import write_safetensors
from zerobridge.checkpoint.layout import ZB, rank_key, whole
from zerobridge.checkpoint.reader import Checkpoint, open_checkpoint
from zerobridge.checkpoint.sharded import engine_pieces, load_engine, replicated_pieces
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Blob, Piece, agree, write_checkpoint

if TYPE_CHECKING:
    from zerobridge.engine import Engine

__all__ = ["load_checkpoint", "load_native", "metadata_json", "save_checkpoint", "save_full", "save_native", "saved_ranks",
           "tensor_piece"]

METADATA_KEY = f"{ZB}.metadata"
LAYOUT_KEY = f"{ZB}.layout"


def metadata_json(metadata: dict[str, Any] | None) -> str:
    """``metadata`` as JSON text; ``CheckpointError`` if it is not JSON-able."""
    try:
        return json.dumps(metadata or {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"must be JSON ({exc})", key="metadata",
                              fix="pass numbers, strings, booleans, lists and dicts with string keys only") from None


def tensor_piece(key: str, value: torch.Tensor) -> Piece:
    """A whole tensor saved under ``key`` as one chunk."""
    shape = tuple(value.shape)
    return Piece(key, whole(shape), shape, value.dtype, partial(lambda v: v, value))


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    metadata: dict[str, Any] | None = None) -> Path:
    """Write a sharded checkpoint of a prepared ``model`` (and ``optimizer``) at ``path``. Collective.

    Each rank writes its own runs (first replica only) in
    ``torch.distributed.checkpoint`` format with FSDP2's keys; master values
    (fp32 under mixed precision), optimizer state and param groups, the loss
    scaler, skipped steps and every rank's RNG states. ``metadata``
    (JSON-able, e.g. ``{"step": 100}``) comes back from ``load_checkpoint``.
    Call it after ``optimizer.step()``: gradients are not saved. The previous
    checkpoint at ``path`` stays until the new one is complete.
    """
    from zerobridge.backends import backend_of

    return backend_of(model).save_checkpoint(Path(path), optimizer, metadata)


def save_native(path: Path, model: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer | None,
                metadata: dict[str, Any] | None) -> Path:
    """``save_checkpoint`` on the native engine: every rank its own runs."""
    text = metadata_json(metadata)
    pieces, blobs = engine_pieces(engine, optimizer)
    pieces += [tensor_piece(rank_key(engine.mesh.rank, name), value) for name, value in capture_rng().items()]
    layout = layout_summary(engine)
    if engine.mesh.rank == 0:
        more, groups = replicated_pieces(engine, optimizer, model)
        pieces += more + [tensor_piece(f"{ZB}.{name}", value) for name, value in stepping_state(engine).items()]
        blobs += groups + [Blob(LAYOUT_KEY, layout), Blob(METADATA_KEY, text)]
    write_checkpoint(path, pieces, blobs, distributed=True,
                     saved={**layout, "zerobridge": __version__, "torch": torch.__version__})
    return path


def saved_ranks(ckpt: Checkpoint) -> dict[int, dict[str, str]]:
    """Saved rank -> {RNG name: key} of the per-rank RNG states in ``ckpt``."""
    ranks: dict[int, dict[str, str]] = {}
    prefix = f"{ZB}.rng."
    for key in ckpt.keys():
        if key.startswith(prefix) and ckpt.tensor(key) is not None:
            rank, _, name = key[len(prefix):].partition(".")
            if rank.isdigit():
                ranks.setdefault(int(rank), {})[name] = key
    return ranks


def user_metadata(ckpt: Checkpoint) -> dict[str, Any]:
    """What ``save_checkpoint(metadata=...)`` stored; ``{}`` when absent (e.g. an FSDP2 checkpoint)."""
    if not ckpt.is_bytes(METADATA_KEY):
        return {}
    text = ckpt.read_bytes([METADATA_KEY])[METADATA_KEY]
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise CheckpointError("is not a JSON object", source=ckpt.source, key=METADATA_KEY,
                              fix="restore the checkpoint from a good copy")
    return value


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    strict: bool = True, rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint into a prepared ``model`` (and ``optimizer``), resharding
    to this run's stage, world size and layout. Collective. Returns the
    ``metadata`` passed to ``save_checkpoint`` (``{}`` if none).

    Files are checked against the manifest first (each rank a share);
    ``strict``: every parameter and buffer must be in the checkpoint and it
    may hold no others, and with an ``optimizer`` the checkpoint must hold
    optimizer state. Param groups are matched by position (same parameter
    names in each), state by parameter name. ``rng``: restore RNG states,
    rank ``r`` taking saved rank ``r mod saved world size``. Checkpoints
    written by ``torch.distributed.checkpoint`` (FSDP2) load too, unverified
    (they have no manifest).
    """
    from zerobridge.backends import backend_of

    return backend_of(model).load_checkpoint(Path(path), optimizer, strict=strict, rng=rng)


def load_native(path: Path, model: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer | None, *,
                strict: bool, rng: bool) -> dict[str, Any]:
    """``load_checkpoint`` on the native engine: each rank reads the chunks its runs overlap."""
    ckpt = open_checkpoint(path, distributed=True)
    load_engine(ckpt, engine, model, optimizer, strict=strict)
    extras = {name: ckpt.full(f"{ZB}.{name}") for name in ("loss_scaler", "skipped_steps")
              if ckpt.tensor(f"{ZB}.{name}") is not None}
    restore_stepping(engine, extras)
    ranks = saved_ranks(ckpt)
    if rng and ranks:
        source = ranks.get(engine.mesh.rank % len(ranks), {})
        restore_rng({name: ckpt.full(key) for name, key in source.items()})
    return user_metadata(ckpt)


def save_full(path: str | Path, model: nn.Module, *, dtype: torch.dtype | None = None) -> Path:
    """Write the whole model's weights (``zerobridge.full_state_dict``) as one
    safetensors file, floating tensors cast to ``dtype`` if given. Collective:
    the values are gathered group by group into rank 0's host memory, and rank
    0 writes (atomically)."""
    from zerobridge.api import full_state_dict

    whole = full_state_dict(model, rank0_only=True, offload_to_cpu=True)  # one group at a time, to rank 0's host
    state = {k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            write_safetensors(path, state, dtype=dtype)
        except (OSError, CheckpointError) as exc:
            error = exc
    agree(distributed, error)
    return Path(path)
