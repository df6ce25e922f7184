"""Every random generator's state, as tensors a checkpoint can hold, and back.

    >>> import random, torch
    >>> from zerobridge.checkpoint.rng import capture_rng, restore_rng
    >>> saved = capture_rng()
    >>> a = (torch.rand(2).tolist(), random.random())
    >>> restore_rng(saved)
    >>> (torch.rand(2).tolist(), random.random()) == a
    True

Everything is a tensor, so it is stored as DCP tensor items (no pickle):
RNG states per rank as ``zerobridge.rng.<rank>.<generator>`` (torch CPU and
CUDA as their byte states; Python's and NumPy's Mersenne Twister as int64
words, a cached Gaussian as the int64 bit pattern of its float64). Every
backend saves them the same way, rank ``r`` under its own keys.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def _float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generator states: ``torch``, ``cuda`` (when initialized), ``python``,
    ``numpy`` (when importable)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    version, words, gauss = random.getstate()
    states["python"] = torch.tensor([version, *words, int(gauss is not None),
                                     _float_bits(gauss) if gauss is not None else 0], dtype=torch.int64)
    try:
        import numpy as np
    except ImportError:
        return states
    state: Any = np.random.get_state()
    _, keys, pos, has_gauss, cached = state
    states["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss, _float_bits(cached)], dtype=torch.int64)
    return states


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    """Set the generators ``states`` has (``capture_rng``'s layout)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"].to(torch.uint8))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].to(torch.uint8))
    if "python" in states:
        words = states["python"].tolist()
        gauss = _bits_float(words[-1]) if words[-2] else None
        random.setstate((words[0], tuple(words[1:-2]), gauss))
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:
            return
        words = states["numpy"].tolist()
        np.random.set_state(("MT19937", np.array(words[:-3], dtype=np.uint32), words[-3], words[-2],
                             _bits_float(words[-1])))
