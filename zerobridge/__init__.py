"""zerobridge: one partitioning spec for DeepSpeed ZeRO and PyTorch FSDP.

    >>> import zerobridge
    >>> callable(zerobridge.prepare)
    True

The training API (``prepare``, ``clip_grad_norm_``, ``full_state_dict``,
``stats``, ``reset_stats``) loads torch on first use, so config conversion
stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["clip_grad_norm_", "full_state_dict", "prepare", "reset_stats", "stats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from zerobridge import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerobridge' has no attribute {name!r}")
