"""``compare --plan-memory``, on each rank: the run's peak live tensor bytes, counted as ``plan`` counts them.

``train`` is compare's own rank function (``zerobridge.compare.worker:train``:
the same model, data, loop and clipping) run inside the planner's
``StorageTracker`` (``zerobridge.planning.tracker``). The tracker starts
before the workload is built, so every storage the rank creates is counted
from its first operation; where the worker's training steps begin (right after
``prepare``, where the resident-set mark is reset) every tensor the garbage
collector can reach is adopted as well, so a storage made outside torch's
dispatcher (or before the tracker) still counts. The peak is the highest live
bytes from there to the end of the last step: what the plan calls the peak of
its training phases (``forward``, ``backward``, ``step``; ``setup`` left out),
on every device summed.

    >>> from zerobridge.compare.peaks import PlannedPeak
    >>> PlannedPeak("fsdp2", 1100, None).error(1000)
    0.1
    >>> PlannedPeak("deepspeed", None, "not modelled: stage 1").error(1000) is None
    True
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from zerobridge.compare import worker
from zerobridge.compare.worker import RankRecord
from zerobridge.errors import ConfigError
from zerobridge.planning.tracker import StorageTracker
from zerobridge.runtime.tensors import local_tensor

__all__ = ["STEPS", "PlannedPeak", "TrackedRecord", "train"]

STEPS = "steps"
"""The tracker's phase from the first training step to the end of the last."""


@dataclass(frozen=True)
class PlannedPeak:
    """What ``zerobridge plan`` says one compare run peaks at, on the flavor that run's backend is."""

    flavor: str
    """``native``, ``fsdp2`` or ``deepspeed``."""
    bytes: int | None
    """The plan's per-rank peak (rank 0, every device summed); None where the plan does not model the run."""
    note: str | None
    """Why there is no number, or what the plan ran differently (FSDP2's closest form of ZeRO-1/2)."""

    def error(self, measured: int | None) -> float | None:
        """``(planned - measured) / measured``; None without both numbers."""
        if self.bytes is None or not measured:
            return None
        return (self.bytes - measured) / measured


@dataclass(frozen=True)
class TrackedRecord:
    """One rank's ``RankRecord`` and its peak live tensor bytes over the training steps."""

    record: RankRecord
    peak_bytes: int


def _reachable() -> list[torch.Tensor]:
    return [local_tensor(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and not o.is_meta]


def train(**kwargs: Any) -> TrackedRecord:
    """``zerobridge.compare.worker.train(**kwargs)`` inside a ``StorageTracker``; the peak of its steps."""
    steps_begin = getattr(worker, "reset_peak_rss", None)
    if steps_begin is None:  # the hook below marks where the steps begin
        raise ConfigError("compare's worker no longer has reset_peak_rss, where --plan-memory starts its steps",
                          key="--plan-memory", fix="mark the start of the steps in zerobridge/compare/peaks.py")
    tracker = StorageTracker()

    def begin() -> bool:
        for tensor in _reachable():
            try:
                tracker.adopt([tensor])
            except (RuntimeError, NotImplementedError):  # a wrapper without storage of its own
                continue
        tracker.phase = STEPS
        return bool(steps_begin())

    worker.reset_peak_rss = begin  # this rank process runs one compare run
    try:
        with tracker:
            record = worker.train(**kwargs)
    finally:
        worker.reset_peak_rss = steps_begin
    return TrackedRecord(record, tracker.peaks.get(STEPS, 0))
