"""What every backend's checkpoint holds besides tensors: the user's metadata, the layout, per-rank RNG keys.

    >>> from zerobridge.checkpoint.metadata import METADATA_KEY, metadata_json
    >>> METADATA_KEY, metadata_json({"step": 100})
    ('zerobridge.metadata', '{"step": 100}')

``save_checkpoint(metadata=...)`` is stored as JSON text under
``METADATA_KEY`` (anything else is refused before a byte is written), the
saving run's layout under ``LAYOUT_KEY``, and each rank's RNG states under
``rank_key(rank, "rng.<name>")``; ``saved_ranks`` finds them back.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import torch

from zerobridge.checkpoint.layout import ZB, whole
from zerobridge.checkpoint.reader import Checkpoint
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.checkpoint.writer import Piece

__all__ = ["LAYOUT_KEY", "METADATA_KEY", "metadata_json", "saved_ranks", "tensor_piece", "user_metadata"]

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
