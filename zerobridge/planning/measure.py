"""How deep a candidate is measured: at full depth, or at two shallower depths extended along the line to
the full depth (``flavors.measure_flavor`` runs it, on every flavor alike).

    >>> from zerobridge.planning.measure import FULL_DEPTH, SHALLOW
    >>> FULL_DEPTH, SHALLOW
    (12, (5, 6))

Every figure but the peak is exactly linear in the depth of a stack of equal
blocks; ``docs/plan.md`` gives the measured error of the peak (``whole=True``
measures the full depth).
"""

from __future__ import annotations

from zerobridge.planning.fake_run import Measured

__all__ = ["FULL_DEPTH", "SHALLOW", "extend"]

FULL_DEPTH = 12
"""Models up to this many blocks are measured whole; deeper ones at ``SHALLOW`` depths."""
SHALLOW = (5, 6)
"""The two depths a deep model is measured at. Below about 5 blocks the peak of a checkpointed
backward still grows faster than it does further on (a 70B Llama at stage 3: 1.17 GB per block
from 3 to 5, 0.51 GB from 5 on), so the line is drawn from 5 and 6."""


def extend(low: Measured, high: Measured, depths: tuple[int, int], full: int) -> Measured:
    """Every figure of ``low`` and ``high`` (measured at ``depths``) on the line through them, at ``full``."""
    a, b = depths

    def line(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        return {k: max(0, round(y.get(k, 0) + (y.get(k, 0) - x.get(k, 0)) * (full - b) / (b - a)))
                for k in {*x, *y}}

    return Measured(peaks=line(low.peaks, high.peaks), tiers=line(low.tiers, high.tiers),
                    model_states=line(low.model_states, high.model_states),
                    comm_bytes=line(low.comm_bytes, high.comm_bytes), comm_calls=line(low.comm_calls, high.comm_calls))
