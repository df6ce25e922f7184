"""torch.compile on the native engine and on FSDP2: the tiny GPT at 20M and 100M parameters, world 2.

    python bench/compile.py                  # about 15 min on 2 cores
    python bench/compile.py --render         # rewrite the docs table from the saved JSON

Two measurements, each through ``zerobridge.compare`` (fresh 2-process gloo
groups, one thread per rank, the same weights, batches, AdamW and clipping):

1. Compiled vs eager on the native engine at 20M, stages 0 and 3 (one
   comparison: eager and compiled runs side by side): the largest relative
   loss difference per step between the compiled run and the eager run of the
   same stage, and their step-time ratio.
2. Compiled native ZeRO-3 vs compiled FSDP2 (``backend="fsdp"``) at 20M and
   100M (one comparison per preset): step time and peak resident set during
   the steps, as ratios native / FSDP2.

A run's step time is the median of its steps after the first (the first
compiles). Writes ``bench/results/compile.json`` and the table between the
markers in ``docs/benchmarks.md`` (a test checks that the table matches the
JSON). A script, not a test: it asserts nothing about time.
"""

from __future__ import annotations

from typing import Any

from backends import ROOT, SHAPES, measured_line, preset_main, progress, run_named, splice  # noqa: F401  (splice: tests render the block)

from zerobridge.compare.report import Comparison, relative
from zerobridge.compare.runner import RunOutcome
from zerobridge.explain import format_bytes

BEGIN, END = "<!-- bench/compile.py: begin -->", "<!-- bench/compile.py: end -->"
RESULTS = ROOT / "bench" / "results" / "compile.json"
DOC = ROOT / "docs" / "benchmarks.md"


def _figures(run: RunOutcome) -> dict[str, Any]:
    return {"median_step_time_s": run.step_time_s, "steps_peak_rss_bytes": run.steps_peak_rss_bytes,
            "losses": run.losses}


def eager_vs_compiled(steps: int) -> dict[str, Any]:
    """Native engine at 20M, stages 0 and 3: compiled against eager."""
    from zerobridge.compare import plan, run_plan

    shape = SHAPES["20m"]
    out: dict[str, Any] = {}
    runs: dict[bool, Comparison] = {}
    for compiled in (False, True):
        planned = plan(stages=[0, 3], backends=["native"], nproc=2, steps=steps, model="tiny-gpt:20m",
                       compile=compiled, **shape)
        runs[compiled] = run_plan(planned, progress=progress)
    for stage in (0, 3):
        eager, compiled_run = (run_named(runs[c], f"native/stage{stage}") for c in (False, True))
        out[f"stage{stage}"] = {
            "eager": _figures(eager), "compiled": _figures(compiled_run),
            "max_loss_deviation": max(relative(a, b) for a, b in zip(compiled_run.losses, eager.losses)),
            "time_compiled_vs_eager": compiled_run.step_time_s / eager.step_time_s}
    return out


def native_vs_fsdp(preset: str, steps: int) -> dict[str, Any]:
    """Compiled ZeRO-3, native engine against FSDP2, in one comparison."""
    from zerobridge.compare import plan, run_plan

    planned = plan(stages=[3], backends=["native", "fsdp"], nproc=2, steps=steps, model=f"tiny-gpt:{preset}",
                   compile=True, **SHAPES[preset])
    comparison = run_plan(planned, progress=progress)
    native, fsdp = run_named(comparison, "native/stage3"), run_named(comparison, "fsdp/stage3")
    return {"params": comparison.params, "native": _figures(native), "fsdp": _figures(fsdp),
            "max_loss_deviation": comparison.max_deviation(), "ok": comparison.ok,
            "time_native_vs_fsdp": native.step_time_s / fsdp.step_time_s,
            "rss_native_vs_fsdp": (native.steps_peak_rss_bytes or 0) / (fsdp.steps_peak_rss_bytes or 1)}


def table(results: dict[str, Any]) -> str:
    """The Markdown block ``docs/benchmarks.md`` carries between its markers."""
    lines = [measured_line(results, f"world 2 (gloo, one thread per rank), {results['steps']} steps per run, "
                                    "inductor on CPU"), "",
             "| native engine, 20M | eager step | compiled step | compiled ÷ eager | max loss difference per step |",
             "|---|---|---|---|---|"]
    for stage, row in results["eager_vs_compiled"].items():
        lines.append(f"| {stage} | {row['eager']['median_step_time_s'] * 1e3:.0f} ms "
                     f"| {row['compiled']['median_step_time_s'] * 1e3:.0f} ms | {row['time_compiled_vs_eager']:.2f} "
                     f"| {row['max_loss_deviation']:.1e} |")
    lines += ["", "| compiled ZeRO-3 | native step | FSDP2 step | step time native ÷ FSDP2 | native peak RSS "
              "| FSDP2 peak RSS | peak RSS native ÷ FSDP2 | losses agree |", "|---|---|---|---|---|---|---|---|"]
    for preset, row in results["native_vs_fsdp"].items():
        n, f = row["native"], row["fsdp"]
        lines.append(f"| {preset} ({row['params']:,}) | {n['median_step_time_s'] * 1e3:.0f} ms "
                     f"| {f['median_step_time_s'] * 1e3:.0f} ms | {row['time_native_vs_fsdp']:.2f} "
                     f"| {format_bytes(n['steps_peak_rss_bytes'])} | {format_bytes(f['steps_peak_rss_bytes'])} "
                     f"| {row['rss_native_vs_fsdp']:.2f} | {'yes' if row['ok'] else 'NO'} "
                     f"({row['max_loss_deviation']:.1e}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    return preset_main(__file__, __doc__, steps=6, path=RESULTS, table_of=table, markers=(BEGIN, END),
                       measure=lambda presets, steps: {
                           "eager_vs_compiled": eager_vs_compiled(steps),
                           "native_vs_fsdp": {p: native_vs_fsdp(p, steps) for p in presets}})


if __name__ == "__main__":
    raise SystemExit(main())
