"""Where each flavor keeps the 16-bit compute copy (``precision.compute_copy``).

No source format has a key for it: the layout follows from the flavor. DeepSpeed
keeps 16-bit parameters at rest beside fp32 master partitions (``stored``); FSDP1,
FSDP2 and autocast-based DDP keep the fp32 parameters as the master and cast a
16-bit copy only while a unit is gathered or an op runs (``gathered``). Readers
set the flavor's layout; writers report a spec asking for the other one as
equivalent: the numbers agree to the bit (the 16-bit copy is the cast of the
fp32 master either way), only where the copy lives, and so the memory, differs.
No flavor has a knob for it, so it neither fails ``--strict`` nor makes the
FSDP2 or DeepSpeed backends refuse a spec.

    >>> from zerobridge.spec import PrecisionSpec
    >>> from zerobridge.translate.report import Report
    >>> report = Report(source="spec", target="deepspeed")
    >>> write_compute_copy(report, PrecisionSpec(param_dtype="bf16", compute_copy="gathered"), "deepspeed",
    ...                    target="bf16")
    >>> [(e.key, e.status.value) for e in report]
    [('precision.compute_copy', 'equivalent')]
"""

from __future__ import annotations

from typing import Literal

from zerobridge.spec.precision import ComputeCopy, PrecisionSpec
from zerobridge.translate.report import Report, Status

__all__ = ["LAYOUTS", "note_layout", "read_compute_copy", "write_compute_copy"]

Flavor = Literal["deepspeed", "fsdp", "autocast"]

LAYOUTS: dict[Flavor, tuple[ComputeCopy, str]] = {
    "deepspeed": ("stored", "DeepSpeed keeps the 16-bit parameters at rest, partitioned like the parameters, "
                  "beside fp32 master partitions held with the optimizer state"),
    "fsdp": ("gathered", "FSDP keeps the fp32 shard as the master and casts the 16-bit copy of a unit when it "
             "is gathered, freeing it with the unit"),
    "autocast": ("gathered", "autocast keeps the fp32 parameters as the master and casts a 16-bit copy for each "
                 "op that uses them"),
}
"""Each flavor's layout and why."""


def read_compute_copy(report: Report, precision: PrecisionSpec, flavor: Flavor, *, key: str) -> PrecisionSpec:
    """``precision`` with ``flavor``'s layout, noted in ``report`` under
    ``key`` (the source key that switches mixed precision on). Unchanged when
    compute and master weights share one dtype: there is one copy."""
    if not precision.mixed and precision.param_dtype != "auto":
        return precision
    return precision.model_copy(update={"compute_copy": note_layout(report, flavor, key=key)})


def note_layout(report: Report, flavor: Flavor, *, key: str) -> ComputeCopy:
    """``flavor``'s layout, noted in ``report`` as read exactly from ``key``."""
    layout, why = LAYOUTS[flavor]
    report.add(key, Status.EXACT, f"{why} (compute_copy {layout})", target="precision.compute_copy")
    return layout


def write_compute_copy(report: Report, precision: PrecisionSpec, flavor: Flavor, *, target: str) -> None:
    """Report ``precision.compute_copy`` as equivalent when ``flavor`` keeps
    the other layout; nothing when it matches or there is one copy."""
    if not precision.mixed and precision.param_dtype != "auto":
        return
    layout, why = LAYOUTS[flavor]
    if precision.compute_copy != layout:
        report.add("precision.compute_copy", Status.EQUIVALENT, f"{why}: written as {layout} (the spec says "
                   f"{precision.compute_copy}); the numbers agree to the bit, only the memory layout differs "
                   "(zerobridge explain shows both)", target=target)
