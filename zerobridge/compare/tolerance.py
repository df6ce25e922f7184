"""How far two runs may drift apart and still agree: bounds derived from what they compute in.

    >>> from zerobridge.compare.tolerance import calibrated, fixed
    >>> fixed(1e-5, 1e-4, steps=2, source="fp32").loss
    [1e-05, 1e-05]
    >>> t = calibrated(loss_deviation=[0.0, 2e-5, 1e-5], norm_deviation=[5e-5, 0.0, 0.0], dtype="bf16")
    >>> t.loss, t.grad_norm
    ([1e-05, 0.0002, 0.0002], [0.0005, 0.0005, 0.0005])

Runs in fp32 differ by reduction order alone, a few units of float32
roundoff per step: a fixed 1e-5 on losses and 1e-4 on gradient norms (as
docs/compare.md explains) holds them. Runs in bf16 or fp16 round every
activation; two correct runs that only sum in another order drift apart by
far more, and by more each step. So ``zerobridge compare`` measures that
drift: it trains the reference's spec once more in one process (the whole
batch on one rank: every reduction in another order) and bounds each step by
``FACTOR`` times the largest deviation the rerun showed up to that step,
never below the fp32 bound. A bug (a dropped or doubled reduction) moves a
run by percents at the step it happens, far outside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FACTOR", "LOSS_FLOOR", "NORM_FLOOR", "Tolerance", "calibrated", "fixed"]

LOSS_FLOOR, NORM_FLOOR = 1e-5, 1e-4
"""The fp32 bounds, and the least a derived bound may be."""
FACTOR = 10.0
"""How many times the rerun's drift a run may show."""


@dataclass(frozen=True)
class Tolerance:
    """Per-step relative bounds on losses and gradient norms, and where they came from."""

    loss: list[float]
    grad_norm: list[float]
    source: str
    """One line for people: the dtype and how the bounds were set."""

    def at(self, metric: str, step: int) -> float:
        bounds = self.loss if metric == "loss" else self.grad_norm
        return bounds[min(step, len(bounds) - 1)]

    def describe(self) -> str:
        if len(set(self.loss)) == 1 and len(set(self.grad_norm)) == 1:
            return f"tolerance {self.loss[0]:g} on losses, {self.grad_norm[0]:g} on grad norms ({self.source})"
        return (f"tolerance {self.loss[0]:.1e} to {self.loss[-1]:.1e} on losses, {self.grad_norm[0]:.1e} to "
                f"{self.grad_norm[-1]:.1e} on grad norms per step ({self.source})")


def fixed(loss: float, grad_norm: float, *, steps: int, source: str) -> Tolerance:
    """The same bounds at every step."""
    return Tolerance([loss] * steps, [grad_norm] * steps, source)


def _running(deviation: Sequence[float], floor: float) -> list[float]:
    out, worst = [], 0.0
    for value in deviation:
        worst = max(worst, value)
        out.append(max(floor, FACTOR * worst))
    return out


def calibrated(*, loss_deviation: Sequence[float], norm_deviation: Sequence[float], dtype: str) -> Tolerance:
    """Bounds from a same-precision rerun's deviation from the reference, step by step."""
    return Tolerance(_running(loss_deviation, LOSS_FLOOR), _running(norm_deviation, NORM_FLOOR),
                     f"{dtype}: {FACTOR:g} x the drift of a one-process {dtype} rerun up to each step, at least "
                     f"{LOSS_FLOOR:g} and {NORM_FLOOR:g}")
