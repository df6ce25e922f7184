"""zerobridge: one partitioning spec for DeepSpeed ZeRO and PyTorch FSDP.

    >>> import zerobridge
    >>> callable(zerobridge.prepare)
    True

The training API (``prepare``, ``clip_grad_norm_``, ``full_state_dict``,
``stats``, ``reset_stats``) and checkpoints (``save_checkpoint``,
``load_checkpoint``, ``save_full``, ``load_pretrained``) load torch on first use, so config
conversion stays fast.
"""

from __future__ import annotations

from typing import Any

from zerobridge._version import __version__ as __version__

__all__ = ["clip_grad_norm_", "full_state_dict", "load_checkpoint", "load_pretrained", "prepare", "reset_stats",
           "save_checkpoint", "save_full", "stats"]
_CHECKPOINT = frozenset({"load_checkpoint", "save_checkpoint", "save_full"})


def __getattr__(name: str) -> Any:
    if name in _CHECKPOINT:
        from zerobridge.checkpoint import api as checkpoint_api

        return getattr(checkpoint_api, name)
    if name == "load_pretrained":
        from zerobridge.pretrained.load import load_pretrained

        return load_pretrained
    if name in __all__:
        from zerobridge import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerobridge' has no attribute {name!r}")
