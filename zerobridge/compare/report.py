"""Judge a comparison and write it out: terminal table, JSON, Markdown.

    >>> from zerobridge.compare.report import relative
    >>> relative(2.0, 2.0), relative(3.0, 2.0), relative(1.0, 0.0)
    (0.0, 0.5, 1.0)

The first run that finished is the reference. Every other run is compared
with it step by step, in loss and in the global gradient norm before
clipping, relative to the reference's value; a run *diverges* at the first
step where the loss differs by more than ``tolerance``, the norm by more
than ``norm_tolerance``, or either is not finite. The norm gets its own
bound because it sums the squares of every gradient element; every engine
accumulates it in float64, so sharding moves it by about 1e-7 (measured at
20M parameters). Runs a backend only approximates (``~``) are judged the
same way. A comparison is ``ok`` when no run diverged and none failed; its
``status`` tells the two apart: ``disagree`` when a finished run left the
reference, else ``failed`` when a run never started or crashed (then nothing
was compared for it), and ``zerobridge compare`` exits 1 or 3 for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zerobridge.compare import peak_report
from zerobridge.compare.runner import RunOutcome, Skipped
from zerobridge.compare.tolerance import Tolerance
from zerobridge.explain import format_bytes

__all__ = ["Comparison", "Divergence", "display_name", "relative"]

_KINDS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def display_name(run: RunOutcome) -> str:
    """The run's name, marked `` ~`` when the backend ran its closest form (tables, plot legends)."""
    return run.planned.name + (" ~" if run.planned.approximations else "")


def relative(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (absolute when the reference is 0; inf when either is not finite)."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    scale = abs(reference) if reference else 1.0
    return abs(value - reference) / scale


@dataclass(frozen=True)
class Divergence:
    """Where a run first left the reference."""

    run: str
    step: int
    metric: str
    """``loss`` or ``grad_norm``."""
    value: float
    reference: float
    deviation: float

    tolerance: float
    """The bound it broke."""

    def describe(self, reference_name: str) -> str:
        """One line naming the run, the step and the numbers."""
        return (f"{self.run} diverges from {reference_name} at step {self.step}: {self.metric} {self.value:.8g} vs "
                f"{self.reference:.8g} (relative {self.deviation:.2e} > tolerance {self.tolerance:.2g})")


MISMATCH = 0.05
"""Relative difference between an engine's own model-state total and every live storage of its
process beyond which the table marks the run ``≠``."""


def live_mismatch(run: RunOutcome) -> float | None:
    """How far the engine's own model-state total is from the independently measured total: every
    live storage, ``other`` included (an engine's own buffers point at no parameter; what is left
    besides model state after backward is a few batch rows and small buffers)."""
    own = sum(run.model_state_bytes.values())
    live = sum(run.live_bytes.values())
    return None if not run.live_bytes or not own else abs(own - live) / own


def live_cell(run: RunOutcome) -> str:
    """The independent measurement beside the engine's: ``≠`` when they disagree by more than 5%."""
    if not run.live_bytes:
        return "-"
    live, off = run.live_bytes, live_mismatch(run)
    mark = f" ≠ {off:.0%}" if off is not None and off > MISMATCH else ""
    return (f"{format_bytes(live['params'])} / {format_bytes(live['grads'])} / {format_bytes(live['optimizer'])} "
            f"+ {format_bytes(live['other'])}{mark}")


def compute_dtype(spec: Any) -> str:
    """``fp32``, ``bf16`` or ``fp16``: what a run's forward computes in."""
    value = str(getattr(spec.precision.param_dtype, "value", spec.precision.param_dtype))
    return value if value in ("bf16", "fp16") else "fp32"


def run_kind(spec: Any) -> str:
    """What a run's tolerance is keyed by: its compute dtype, and the payloads it quantizes
    (``bf16 gather=int8 reduce=int4``): each kind drifts by its own amount."""
    wire = spec.communication.wire
    quantized = [f"{name}={fmt.value}" for name, fmt in (("gather", wire.param_gather),
                                                         ("reduce", wire.grad_reduce)) if fmt.value != "full"]
    return " ".join([compute_dtype(spec), *quantized])


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass
class Comparison:
    """Every run of one ``zerobridge compare``, and what was skipped."""

    runs: list[RunOutcome]
    skipped: list[Skipped]
    tolerance: float
    """Relative bound on each step's loss."""
    norm_tolerance: float
    """Relative bound on each step's gradient norm."""
    model: str
    params: int
    world_size: int
    steps: int
    compiled: bool = False
    """Every run was under ``torch.compile`` (``--compile``)."""
    derived: tuple[bool, bool] = (False, False)
    """Whether the loss and the grad-norm bounds of 16-bit runs come from ``tolerances`` (no
    ``--tolerance`` / ``--norm-tolerance`` given); fp32 runs keep the two numbers above."""
    tolerances: dict[str, Tolerance] = field(default_factory=dict)
    """Per run kind (``run_kind``: ``bf16``, ``fp16``, ``bf16 gather=int8``, ...): the bounds
    calibrated after the runs."""

    def bound(self, run: RunOutcome, metric: str, step: int) -> float:
        """How far ``run`` may be from the reference at ``step``: the looser of the bounds of
        the two runs' compute dtypes."""
        fixed = self.tolerance if metric == "loss" else self.norm_tolerance
        if not self.derived[0 if metric == "loss" else 1]:
            return fixed
        kinds = {run_kind(run.planned.spec)} | ({run_kind(self.reference.planned.spec)} if self.reference else set())
        return max([fixed] + [self.tolerances[k].at(metric, step) for k in kinds if k in self.tolerances])

    def tolerance_lines(self) -> list[str]:
        """How the runs were judged, one line per compute dtype."""
        lines = [f"fp32: tolerance {self.tolerance:g} on losses, {self.norm_tolerance:g} on grad norms"
                 + ("" if all(self.derived) else " (given)")]
        return lines + [f"{dtype}: {t.describe()}" for dtype, t in self.tolerances.items()]

    @property
    def reference(self) -> RunOutcome | None:
        """The first run that finished."""
        return next((r for r in self.runs if r.error is None), None)

    def deviations(self, run: RunOutcome, metric: str = "loss") -> list[float]:
        """Per step, ``run``'s relative deviation from the reference."""
        ref = self.reference
        if ref is None or run.error is not None:
            return []
        ours, theirs = (run.losses, ref.losses) if metric == "loss" else (run.grad_norms, ref.grad_norms)
        return [relative(a, b) for a, b in zip(ours, theirs)]

    def divergence(self, run: RunOutcome) -> Divergence | None:
        """The first step where ``run`` leaves the reference by more than the tolerance."""
        ref = self.reference
        if ref is None or run.error is not None:
            return None
        for step in range(len(ref.losses)):
            for metric, ours, theirs in (("loss", run.losses, ref.losses),
                                         ("grad_norm", run.grad_norms, ref.grad_norms)):
                bound = self.bound(run, metric, step)
                if step >= len(ours):
                    return Divergence(run.planned.name, step, metric, math.nan, theirs[step], math.inf, bound)
                deviation = relative(ours[step], theirs[step])
                if deviation > bound:
                    return Divergence(run.planned.name, step, metric, ours[step], theirs[step], deviation, bound)
        return None

    @property
    def divergences(self) -> list[Divergence]:
        """Every diverging run's first divergence, in run order."""
        return [d for d in (self.divergence(r) for r in self.runs) if d is not None]

    @property
    def failed(self) -> list[RunOutcome]:
        """Runs that did not finish."""
        return [r for r in self.runs if r.error is not None]

    @property
    def ok(self) -> bool:
        """Every run finished and agrees with the reference within the tolerance."""
        return bool(self.runs) and not self.failed and not self.divergences

    @property
    def status(self) -> str:
        """``ok``; ``disagree`` when a finished run diverged; else ``failed`` when a run did not finish."""
        if self.divergences:
            return "disagree"
        return "failed" if self.failed or not self.runs else "ok"

    def max_deviation(self, metric: str = "loss") -> float:
        """The largest relative deviation over all runs and steps."""
        return max((d for r in self.runs for d in self.deviations(r, metric)), default=0.0)

    def verdict(self) -> str:
        """One line for people, and a line per problem."""
        ref = self.reference
        lines = [d.describe(ref.planned.name if ref else "?") for d in self.divergences]
        mixed = sorted({compute_dtype(r.planned.spec) for r in self.runs if r.error is None})
        if self.divergences and len(mixed) > 1:
            lines.append(f"  note: the runs compute in {' and '.join(mixed)}: a run in another precision than the "
                         "reference diverges by design; compare configs of one precision, or pass --tolerance and "
                         "--norm-tolerance wide enough for the difference")
        lines += [f"failed {r.planned.name}: {r.error}" for r in self.failed]
        if self.divergences:
            return "\n".join(["zerobridge compare: runs disagree", *lines])
        if self.failed:
            finished = len(self.runs) - len(self.failed)
            head = (f"zerobridge compare: {len(self.failed)} run(s) failed (never started or crashed); "
                    + (f"the {finished} that finished agree" if finished else "no run finished, nothing was compared"))
            return "\n".join([head, *lines])
        judged = "; ".join(self.tolerance_lines())
        return (f"OK: {len(self.runs)} run(s) agree with {ref.planned.name if ref else '-'} over {self.steps} "
                f"steps: max loss deviation {self.max_deviation():.2e}, max grad-norm deviation "
                f"{self.max_deviation('grad_norm'):.2e} ({judged})")

    # --- JSON -------------------------------------------------------------------------------------------

    def run_json(self, run: RunOutcome) -> dict[str, Any]:
        """One run as JSON-compatible data (non-finite numbers become null)."""
        loss_dev = self.deviations(run)
        norm_dev = self.deviations(run, "grad_norm")
        diverged = self.divergence(run)
        return {
            "name": run.planned.name, "backend": run.planned.backend, "stage": run.planned.stage,
            "label": run.planned.label, "world_size": run.world_size,
            "losses": [_finite(x) for x in run.losses], "grad_norms": [_finite(x) for x in run.grad_norms],
            "loss_deviation": [_finite(x) for x in loss_dev],
            "max_loss_deviation": _finite(max(loss_dev, default=0.0)),
            "max_grad_norm_deviation": _finite(max(norm_dev, default=0.0)),
            "model_state_bytes": dict(run.model_state_bytes), "live_bytes": dict(run.live_bytes),
            "live_mismatch": live_mismatch(run),
            "formula_model_state_bytes": run.formula_model_state_bytes,
            "tier_bytes": dict(run.tier_bytes),
            "peak_rss_bytes": run.peak_rss_bytes, "steps_peak_rss_bytes": run.steps_peak_rss_bytes,
            "baseline_rss_bytes": run.baseline_rss_bytes,
            "comm_bytes": {k: round(v) for k, v in run.comm_bytes.items()},
            "formula_comm_bytes": run.formula_comm_bytes,
            "step_time_s": _finite(run.step_time_s), "step_times_s": list(run.step_times),
            "approximations": [*run.planned.approximations], "formula_stage": run.planned.formula_stage,
            "diverged_at": None if diverged is None else {"step": diverged.step, "metric": diverged.metric,
                                                          "deviation": _finite(diverged.deviation)},
            "error": run.error, "wall_s": round(run.wall_s, 3), **peak_report.peak_json(run),
        }

    def to_json(self) -> dict[str, Any]:
        """The whole comparison (the schema ``docs/compare.md`` lists)."""
        ref = self.reference
        return {
            "ok": self.ok, "status": self.status, "max_loss_deviation": _finite(self.max_deviation()),
            "max_grad_norm_deviation": _finite(self.max_deviation("grad_norm")),
            "tolerance": self.tolerance, "norm_tolerance": self.norm_tolerance,
            "reference": ref.planned.name if ref else None,
            "tolerances": {d: {"loss": t.loss, "grad_norm": t.grad_norm, "source": t.source}
                           for d, t in self.tolerances.items()},
            "model": self.model, "params": self.params, "world_size": self.world_size, "steps": self.steps,
            "compiled": self.compiled, "runs": [self.run_json(r) for r in self.runs],
            "approximated": [r.planned.name for r in self.runs if r.planned.approximations],
            "skipped": [{"backend": s.backend, "stage": s.stage, "label": s.label, "reason": s.reason}
                        for s in self.skipped],
            "divergences": [{"run": d.run, "step": d.step, "metric": d.metric, "value": _finite(d.value),
                             "reference": d.reference, "deviation": _finite(d.deviation)} for d in self.divergences],
            "failed": [{"run": r.planned.name, "error": r.error} for r in self.failed],
        }

    # --- tables -----------------------------------------------------------------------------------------

    def _rows(self) -> list[list[str]]:
        rows = []
        ref = self.reference
        for run in self.runs:
            name = display_name(run)
            if run.error is not None:
                rows.append([name, str(run.planned.stage), "failed", "", "", "", "", "", "", "", ""])
                continue
            state = run.model_state_bytes
            total = sum(state.values())
            formula = run.formula_model_state_bytes
            comm = " ".join(f"{_KINDS.get(k, k)} {format_bytes(round(v))}" for k, v in sorted(run.comm_bytes.items()))
            dev = "ref" if run is ref else f"{max(self.deviations(run), default=0.0):.1e}"
            norm = "ref" if run is ref else f"{max(self.deviations(run, 'grad_norm'), default=0.0):.1e}"
            rows.append([name, str(run.planned.stage), f"{run.losses[-1]:.6f}" if run.losses else "-", dev, norm,
                         f"{format_bytes(state.get('params', 0))} / {format_bytes(state.get('grads', 0))} / "
                         f"{format_bytes(state.get('optimizer', 0))}",
                         (f"{total / formula:.3f}" + (f" (ZeRO-{run.planned.formula_stage})"
                                                      if run.planned.formula_stage is not None else ""))
                         if formula else "-",
                         live_cell(run),
                         format_bytes(run.peak_rss_bytes) + (f" / {format_bytes(run.steps_peak_rss_bytes)}"
                                                             if run.steps_peak_rss_bytes is not None else ""),
                         comm or "-", f"{run.step_time_s * 1e3:.1f}"])
        return rows

    _HEAD = ["run", "stage", "final loss", "loss dev", "norm dev", "state/rank: params / grads / optim",
             "vs formula", "live (gc): params / grads / optim + other", "peak RSS: run / steps", "comm/step/rank",
             "step ms"]

    def _steps(self) -> list[list[str]]:
        ref = self.reference
        if ref is None:
            return []
        rows = []
        for step in range(len(ref.losses)):
            worst, name = 0.0, "-"
            for run in self.runs:
                devs = self.deviations(run)
                if run is not ref and step < len(devs) and devs[step] > worst:
                    worst, name = devs[step], run.planned.name
            rows.append([str(step), f"{ref.losses[step]:.6f}", f"{ref.grad_norms[step]:.6f}", f"{worst:.1e}", name])
        return rows

    def approximated(self) -> list[str]:
        """One line per run that ran a backend's closest form: what it approximates, and the
        formula its memory is measured against when that is another stage's."""
        lines = []
        for run in self.runs:
            if run.planned.approximations:
                against = (f"; memory against the ZeRO-{run.planned.formula_stage} formula"
                           if run.planned.formula_stage is not None else "")
                lines.append(f"~ {run.planned.name} is approximated ({', '.join(run.planned.approximations)}): the "
                             f"backend's closest form, judged like the others{against} (--exact-only skips it)")
        return lines

    def _peaks(self, table: Callable[[list[str], list[list[str]]], str]) -> list[str]:
        rows = peak_report.peak_rows(self.runs)
        return ["", "peak live tensor bytes per rank over the steps, planned (zerobridge plan) vs measured:",
                table(peak_report.HEAD, rows)] if rows else []

    def render(self) -> str:
        """The terminal report: runs, skipped pairs, per-step agreement, verdict."""
        out = [f"{self.model}: {self.params:,} parameters, world {self.world_size}, {self.steps} steps"
               + (", compiled" if self.compiled else ""), "",
               _table(self._HEAD, self._rows()), *self.approximated(), *self._peaks(_table)]
        out += [f"skipped {s.backend}/{s.label}: {s.reason}" for s in self.skipped]
        if len(self.runs) > 1 and self.reference is not None:
            out += ["", f"per step, against {self.reference.planned.name}:",
                    _table(["step", "loss", "grad norm", "max loss dev", "worst run"], self._steps())]
        out += ["", self.verdict()]
        return "\n".join(out) + "\n"

    def markdown(self) -> str:
        """The report as Markdown (a CI job summary)."""
        mark = "✅" if self.ok else "❌"
        out = [f"## zerobridge compare {mark}", "",
               f"`{self.model}`, {self.params:,} parameters, world size {self.world_size}, {self.steps} steps, "
               + ("compiled, " if self.compiled else "") +
               f"judged against `{self.reference.planned.name if self.reference else '-'}`: "
               + "; ".join(self.tolerance_lines()),
               "", _markdown_table(self._HEAD, self._rows()), "", *self._peaks(_markdown_table)]
        if self.approximated():
            out += [f"- {line.removeprefix('~ ')}" for line in self.approximated()] + [""]
        if self.skipped:
            out += ["**Skipped** (the backend cannot express the spec):", ""]
            out += [f"- `{s.backend}/{s.label}`: {s.reason}" for s in self.skipped] + [""]
        out += ["```", self.verdict(), "```", ""]
        done = [r for r in self.runs if r.error is None]
        if done:
            head = ["step", *[f"`{r.planned.name}`" for r in done]]
            rows = [[str(i), *[f"{r.losses[i]:.7f}" if i < len(r.losses) else "-" for r in done]]
                    for i in range(max(len(r.losses) for r in done))]
            out += ["<details><summary>Loss per step</summary>", "", _markdown_table(head, rows), "", "</details>", ""]
        return "\n".join(out)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)
