"""What sharding costs the native engine: ZeRO-3's step time over stage 0's, at 20M and 100M, eager and compiled.

    python bench/zero3_overhead.py                   # about 20 min on 2 cores
    python bench/zero3_overhead.py --presets 20m     # about 6 min
    python bench/zero3_overhead.py --render          # rewrite the docs table from the saved JSON

Each repetition is one ``zerobridge.compare`` of native stage 0 and native
stage 3 (fresh 2-process gloo groups, one thread per rank, the same weights,
batches, AdamW and clipping), eager, then compiled; a run's step time is the
median of its steps after the first (the first compiles). The ratio is taken
within a repetition (the two runs are seconds apart) and the table gives the
median over ``REPS`` repetitions, with each repetition's ratio beside it.
Bus bytes per step come from the same runs: ZeRO-3 moves 1.5x stage 0's
(the backward's second all-gather), and on this machine every byte costs
the same two cores the ranks compute on. Writes
``bench/results/zero3_overhead.json`` and the table between the markers in
``docs/benchmarks.md`` (a test checks that the table matches the JSON). A
script, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import statistics
from typing import Any

from backends import ROOT, SHAPES, measured_line, preset_main, progress, run_named, splice  # noqa: F401  (splice: tests render the block)

from zerobridge.explain import format_bytes

BEGIN, END = "<!-- bench/zero3_overhead.py: begin -->", "<!-- bench/zero3_overhead.py: end -->"
RESULTS = ROOT / "bench" / "results" / "zero3_overhead.json"
DOC = ROOT / "docs" / "benchmarks.md"
REPS = 3
"""Repetitions per preset and mode."""


def overhead(preset: str, compiled: bool, steps: int) -> dict[str, Any]:
    """``REPS`` comparisons of native stage 0 and stage 3 on ``preset``: step times and their ratios."""
    from zerobridge.compare import plan, run_plan

    reps = []
    for _ in range(REPS):
        planned = plan(stages=[0, 3], backends=["native"], nproc=2, steps=steps, model=f"tiny-gpt:{preset}",
                       compile=compiled, **SHAPES[preset])
        comparison = run_plan(planned, progress=progress)
        zero, three = run_named(comparison, "native/stage0"), run_named(comparison, "native/stage3")
        reps.append({"stage0_s": zero.step_time_s, "stage3_s": three.step_time_s,
                     "ratio": three.step_time_s / zero.step_time_s, "ok": comparison.ok,
                     "comm_bytes": {"stage0": sum(zero.comm_bytes.values()),
                                    "stage3": sum(three.comm_bytes.values())},
                     "params": comparison.params})
    return {"params": reps[0]["params"], "reps": reps, "median_ratio": statistics.median(r["ratio"] for r in reps)}


def table(results: dict[str, Any]) -> str:
    """The Markdown block ``docs/benchmarks.md`` carries between its markers."""
    lines = [measured_line(results, f"world 2 (gloo, one thread per rank), {results['steps']} steps per run, "
                                    f"{REPS} repetitions"), "",
             "| native engine | stage 0 step | ZeRO-3 step | ZeRO-3 ÷ stage 0 (median) | each repetition "
             "| bus bytes/step ZeRO-3 ÷ stage 0 | losses agree |", "|---|---|---|---|---|---|---|"]
    for key, row in results["overhead"].items():
        reps = row["reps"]
        zero = statistics.median(r["stage0_s"] for r in reps)
        three = statistics.median(r["stage3_s"] for r in reps)
        comm = reps[0]["comm_bytes"]
        each = ", ".join(f"{r['ratio']:.3f}" for r in reps)
        lines.append(f"| {key} ({row['params']:,}) | {zero * 1e3:.0f} ms | {three * 1e3:.0f} ms "
                     f"| {row['median_ratio']:.3f} | {each} "
                     f"| {comm['stage3'] / comm['stage0']:.2f} ({format_bytes(comm['stage3'])} / "
                     f"{format_bytes(comm['stage0'])}) | {'yes' if all(r['ok'] for r in reps) else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    return preset_main(__file__, __doc__, steps=8, path=RESULTS, table_of=table, markers=(BEGIN, END),
                       measure=lambda presets, steps: {"overhead": {
                           f"{preset} {mode}": overhead(preset, mode == "compiled", steps)
                           for preset in presets for mode in ("eager", "compiled")}})


if __name__ == "__main__":
    raise SystemExit(main())
