"""``compare --plan-memory`` in the report: per run, the planned and measured peak and the error.

    >>> from zerobridge.compare.peak_report import HEAD
    >>> HEAD[2:5]
    ['planned peak', 'measured peak', 'error']
"""

from __future__ import annotations

from collections.abc import Sequence

from zerobridge.compare.runner import RunOutcome
from zerobridge.explain import format_bytes

__all__ = ["HEAD", "measured_peak", "peak_json", "peak_rows"]

HEAD = ["run", "plan flavor", "planned peak", "measured peak", "error", "note"]


def measured_peak(run: RunOutcome) -> int | None:
    """The largest rank's peak over the training steps (``--plan-memory`` runs only)."""
    return max(run.peak_bytes) if run.peak_bytes else None


def peak_json(run: RunOutcome) -> dict[str, object]:
    """``plan_flavor``, ``planned_peak_bytes``, ``measured_peak_bytes`` (largest rank), ``peak_bytes_per_rank``,
    ``peak_error`` ((planned - measured) / measured) and ``plan_note``: all null without ``--plan-memory``."""
    plan, measured = run.planned_peak, measured_peak(run)
    return {"plan_flavor": plan.flavor if plan else None, "planned_peak_bytes": plan.bytes if plan else None,
            "measured_peak_bytes": measured, "peak_bytes_per_rank": list(run.peak_bytes),
            "peak_error": plan.error(measured) if plan else None, "plan_note": plan.note if plan else None}


def peak_rows(runs: Sequence[RunOutcome]) -> list[list[str]]:
    """One table row per run that was planned (``HEAD``)."""
    rows = []
    for run in runs:
        plan = run.planned_peak
        if plan is None:
            continue
        measured = measured_peak(run)
        error = plan.error(measured)
        rows.append([run.planned.name, plan.flavor, "-" if plan.bytes is None else format_bytes(plan.bytes),
                     "failed" if run.error else "-" if measured is None else format_bytes(measured),
                     "-" if error is None else f"{error:+.1%}", plan.note or ""])
    return rows
