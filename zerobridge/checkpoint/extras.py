"""What a resumed run needs besides parameters and optimizer state: RNG, loss
scaler, skipped steps, and a description of the layout that saved it.

    >>> import random, torch
    >>> from zerobridge.checkpoint.extras import capture_rng, restore_rng
    >>> saved = capture_rng()
    >>> a = (torch.rand(2).tolist(), random.random())
    >>> restore_rng(saved)
    >>> (torch.rand(2).tolist(), random.random()) == a
    True

Everything is a tensor, so it is stored as DCP tensor items (no pickle):
RNG states per rank as ``zerobridge.rng.<rank>.<generator>`` (torch CPU and
CUDA as their byte states; Python's and NumPy's Mersenne Twister as int64
words, a cached Gaussian as the int64 bit pattern of its float64), the loss
scaler as ``[scale, hysteresis, clean steps]`` and the skipped-step count.
This module and ``layout_summary`` are the only places that read engine
state beyond ``zerobridge.engine.access`` (``engine.stepping``, ``engine.mesh``,
``engine.plan``).
"""

from __future__ import annotations

import random
import struct
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zerobridge.engine.engine import Engine

__all__ = ["capture_rng", "layout_summary", "restore_rng", "restore_stepping", "stepping_state"]


def _float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generator states: ``torch``, ``cuda`` (when initialized), ``python``, ``numpy`` (when importable)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
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


def stepping_state(engine: Engine) -> dict[str, torch.Tensor]:
    """Loss scaler ``[scale, hysteresis, clean steps]`` (float64) and skipped steps (int64)."""
    return {"loss_scaler": engine.stepping.scaler.state_tensor(),
            "skipped_steps": torch.tensor(engine.stepping.skipped_steps, dtype=torch.int64)}


def restore_stepping(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    """Put back what ``stepping_state`` saved. A scaler is restored only when both
    runs scale dynamically (a static or absent scale comes from the spec)."""
    if "loss_scaler" in state:
        engine.stepping.scaler.load_state_tensor(state["loss_scaler"])
    if "skipped_steps" in state:
        engine.stepping.skipped_steps = int(state["skipped_steps"])


def layout_summary(engine: Engine) -> dict[str, Any]:
    """How the saving run was laid out (``checkpoint info`` prints it)."""
    plan, mesh = engine.plan, engine.mesh
    return {"world_size": mesh.world_size, "shard_size": mesh.shard_size, "replicas": mesh.replicas,
            "strategy": plan.spec.summary(), "master_dtype": str(plan.master_dtype).removeprefix("torch."),
            "compute_dtype": str(plan.compute_dtype).removeprefix("torch.")}
