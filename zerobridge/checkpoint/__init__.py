"""Sharded checkpoints in ``torch.distributed.checkpoint`` format, resharded on load;
consolidated safetensors; a single-process portable reader and writer.

    >>> from zerobridge.checkpoint import PortableState
    >>> sorted(PortableState.__dataclass_fields__)
    ['metadata', 'model', 'optimizer', 'param_groups']

Modules, each one concern: ``layout`` (keys, boxes), ``storage`` (manifest,
checks, atomic swap), ``unpickle`` (restricted metadata reading), ``writer``
and ``reader`` (DCP planners), ``sharded`` (an engine rank's part),
``extras`` (RNG, loss scaler), ``full`` (safetensors), ``portable`` (whole
tensors in one process), ``api`` (the three public calls), ``cli``. Names
load on first use, so ``zerobridge checkpoint`` commands import torch only
when they run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError", "PortableState", "load_checkpoint", "read_portable", "save_checkpoint", "save_full",
           "write_portable"]

_LAZY = {"PortableState": "portable", "load_checkpoint": "api", "save_checkpoint": "api", "save_full": "api", "read_portable": "portable",
         "write_portable": "portable", "CheckpointError": "storage"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"zerobridge.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'zerobridge.checkpoint' has no attribute {name!r}")
