"""What every backend's checkpoint holds besides tensors: the user's metadata, the LR scheduler's state, the client
state, the layout, per-rank RNG keys.

    >>> from zerobridge.checkpoint.metadata import METADATA_KEY, metadata_json
    >>> METADATA_KEY, metadata_json({"step": 100})
    ('zerobridge.metadata', '{"step": 100}')

``save_checkpoint(metadata=...)`` is stored as JSON text under
``METADATA_KEY`` (anything else is refused before a byte is written), the
scheduler's ``state_dict()`` and the client state under ``SCHEDULER_KEY`` and
``CLIENT_STATE_KEY`` (``run_state.py``; ``run_blobs`` writes the three,
``read_run_state`` reads them back), the saving run's layout under
``LAYOUT_KEY``, and each rank's RNG states under
``rank_key(rank, "rng.<name>")``; ``saved_ranks`` finds them back.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import torch

from zerobridge.checkpoint.layout import ZB, whole
from zerobridge.checkpoint.reader import Checkpoint
from zerobridge.checkpoint.run_state import CLIENT_STATE_KEY, SCHEDULER_KEY, RunState, check_run
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Blob, Piece, agree

__all__ = ["LAYOUT_KEY", "METADATA_KEY", "metadata_json", "read_run_state", "run_blobs", "saved_ranks",
           "tensor_piece", "user_metadata"]

METADATA_KEY = f"{ZB}.metadata"
"""The user's ``metadata`` (JSON text)."""
LAYOUT_KEY = f"{ZB}.layout"
"""How the saving run was laid out (``checkpoint info`` prints it)."""


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


def saved_ranks(ckpt: Checkpoint) -> dict[int, dict[str, str]]:
    """Saved rank -> {RNG name: key} of the per-rank RNG states in ``ckpt``."""
    ranks: dict[int, dict[str, str]] = {}
    prefix = f"{ZB}.rng."
    for key in ckpt:
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


def run_blobs(run: RunState, *, distributed: bool) -> list[Blob]:
    """The items rank 0 writes for ``run``: the metadata as JSON text, the scheduler's state and the client state
    when given. Collective when ``distributed``: every rank checks its own (``check_run``), and one that refuses
    makes every rank raise, before anything is written."""
    blobs: list[Blob] = []
    error: CheckpointError | None = None
    try:
        blobs.append(Blob(METADATA_KEY, metadata_json(run.metadata)))
        check_run(run)
    except CheckpointError as exc:
        error = exc
    agree(distributed, error)
    if run.scheduler is not None:
        blobs.append(Blob(SCHEDULER_KEY, run.scheduler, checked=True))
    if run.client_state is not None:
        blobs.append(Blob(CLIENT_STATE_KEY, run.client_state, checked=True))
    return blobs


def read_run_state(ckpt: Checkpoint, *, with_scheduler: bool, strict: bool) -> RunState:
    """The metadata, scheduler state and client state of ``ckpt`` (read before anything is loaded, so a
    missing scheduler state fails early). ``with_scheduler`` and ``strict``: the state must be there."""
    if with_scheduler and strict and not ckpt.is_bytes(SCHEDULER_KEY):
        raise CheckpointError("holds no learning-rate scheduler state (saved without scheduler=, or not by "
                              "zerobridge)", source=ckpt.source, key=SCHEDULER_KEY,
                              fix="load with scheduler=None and set the scheduler's position yourself (e.g. build "
                                  "it with last_epoch=<steps taken> - 1 after setting each group's initial_lr), "
                                  "or pass strict=False to skip it")
    keys = [k for k in (SCHEDULER_KEY, CLIENT_STATE_KEY) if ckpt.is_bytes(k)]
    values = ckpt.read_bytes(keys) if keys else {}
    for key, value in values.items():
        if not isinstance(value, dict):
            raise CheckpointError(f"holds a {type(value).__name__}, not a dict", source=ckpt.source, key=key,
                                  fix="restore the checkpoint from a good copy")
    return RunState(metadata=user_metadata(ckpt), scheduler=values.get(SCHEDULER_KEY),
                    client_state=values.get(CLIENT_STATE_KEY))
