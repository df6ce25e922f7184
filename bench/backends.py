"""Native engine vs torch FSDP2 vs DeepSpeed, every ZeRO stage, the tiny GPT at 20M and 100M
parameters, world 2 on CPU: step time and memory side by side, against the ZeRO formulas.

    python bench/backends.py                          # both presets, 3 repetitions: about 25 min on 2 cores
    python bench/backends.py --presets 20m --reps 2   # a quicker look
    python bench/backends.py --render                 # rewrite the docs table and plot from the saved JSON

Each repetition runs every (stage, backend) pair once, in the order of
``zerobridge compare`` and each in a fresh 2-process gloo group (one thread
per rank), through ``zerobridge.compare``: the same model, seed, batches,
AdamW and clipping everywhere. A pair's step time in one repetition is the
median of its steps after the first; its ratio to the native engine at the
same stage is taken within the repetition, so every ratio compares runs
made minutes apart on the same machine state, and the table reports the
median ratio over repetitions. Memory: the model-state bytes a rank holds
(``zerobridge.stats``) over what ``zerobridge explain`` computes from the
ZeRO formulas, and the peak resident set during the training steps (with
glibc's default allocator settings: ``bench/offload_memory.py`` fixes
``MALLOC_MMAP_THRESHOLD_`` so that RSS follows live memory, which here
would slow every step by about a third, so RSS includes what glibc keeps).
Communication: bus bytes per rank per step over the formula.

Writes ``bench/results/backends.json``, ``bench/results/backends.png`` and
the table between the markers in ``docs/benchmarks.md`` (a test checks that
the table matches the JSON). It is a script, not a test: never assert times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from zerobridge.compare.report import Comparison
from zerobridge.compare.runner import RunOutcome
from zerobridge.explain import format_bytes

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench/backends.py: begin -->", "<!-- bench/backends.py: end -->"

RESULTS = ROOT / "bench" / "results" / "backends.json"
PLOT = ROOT / "bench" / "results" / "backends.png"
DOC = ROOT / "docs" / "benchmarks.md"
SHAPES = {"20m": {"global_batch": 4, "seq_len": 128}, "100m": {"global_batch": 4, "seq_len": 128}}


def progress(index: int, total: int, outcome: RunOutcome) -> None:
    """``run_plan``'s progress callback for the benchmarks: one stderr line per finished run."""
    state = f"median step {outcome.step_time_s:.3f} s" if outcome.error is None else f"FAILED {outcome.error}"
    print(f"  [{index + 1}/{total}] {outcome.planned.name:<18} {state}", file=sys.stderr, flush=True)


def run_named(comparison: Comparison, name: str) -> RunOutcome:
    """The run of ``comparison`` named ``name`` (``native/stage3``); exits naming it if it failed."""
    run = next(r for r in comparison.runs if r.planned.name == name)
    if run.error is not None:
        raise SystemExit(f"{name} failed: {run.error}")
    return run


def measured_line(results: dict[str, Any], setup: str) -> str:
    """A table's first line: date, machine and torch of ``results``, then ``setup``, then its command."""
    m = results["machine"]
    return (f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), torch "
            f"{m['torch']}; {setup}; `{results['command'].strip()}`.")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import deepspeed
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "os": platform.platform()}


def summarise(reps: list[Comparison]) -> dict[str, Any]:
    """One preset: per run, medians over repetitions and ratios taken within each repetition."""
    names = [r.planned.name for r in reps[0].runs]
    out: dict[str, Any] = {"params": reps[0].params, "runs": {}, "skipped": reps[0].to_json()["skipped"],
                           "max_loss_deviation": max(c.max_deviation() for c in reps),
                           "max_grad_norm_deviation": max(c.max_deviation("grad_norm") for c in reps),
                           "tolerance": reps[0].tolerance, "norm_tolerance": reps[0].norm_tolerance,
                           "all_ok": all(c.ok for c in reps)}
    for name in names:
        per_rep = [next(r for r in c.runs if r.planned.name == name) for c in reps]
        done = [r for r in per_rep if r.error is None]
        if not done:
            out["runs"][name] = {"error": per_rep[0].error}
            continue
        ratios = []
        for comp, run in zip(reps, per_rep):
            native = next((r for r in comp.runs if r.planned.backend == "native"
                           and r.planned.label == run.planned.label and r.error is None), None)
            if native is not None and run.error is None:
                ratios.append(run.step_time_s / native.step_time_s)
        last = done[-1]
        held = sum(last.model_state_bytes.values())
        comm = sum(last.comm_bytes.values())
        out["runs"][name] = {
            "backend": last.planned.backend, "stage": last.planned.stage,
            "approximations": list(last.planned.approximations), "formula_stage": last.planned.formula_stage,
            "step_time_s": [r.step_time_s for r in done],
            "median_step_time_s": statistics.median(r.step_time_s for r in done),
            "time_vs_native": statistics.median(ratios) if ratios else None,
            "time_vs_native_each": ratios,
            "model_state_bytes": last.model_state_bytes, "formula_model_state_bytes": last.formula_model_state_bytes,
            "state_vs_formula": held / last.formula_model_state_bytes if last.formula_model_state_bytes else None,
            "steps_peak_rss_bytes": statistics.median(r.steps_peak_rss_bytes or 0 for r in done),
            "peak_rss_bytes": statistics.median(r.peak_rss_bytes for r in done),
            "comm_bytes": last.comm_bytes, "formula_comm_bytes": last.formula_comm_bytes,
            "comm_vs_formula": comm / last.formula_comm_bytes if last.formula_comm_bytes else None,
        }
    return out


def plot(results: dict[str, Any], target: Path) -> None:
    """Step time relative to native, and model state relative to the formula, per preset."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    presets = list(results["presets"])
    fig, axes = plt.subplots(2, len(presets), figsize=(6.5 * len(presets), 8), squeeze=False)
    for col, preset in enumerate(presets):
        runs = results["presets"][preset]["runs"]
        names = [n for n, r in runs.items() if "error" not in r]
        colors = {"native": "tab:blue", "fsdp": "tab:orange", "deepspeed": "tab:green"}
        for row, (key, title) in enumerate((("time_vs_native", "step time ÷ native, same stage"),
                                            ("state_vs_formula", "model state ÷ ZeRO formula"))):
            ax = axes[row][col]
            ax.bar(range(len(names)), [runs[n][key] or 0 for n in names],
                   color=[colors[runs[n]["backend"]] for n in names])
            ax.axhline(1.0, color="black", linewidth=0.8)
            labels = [n + (" ~" if runs[n].get("approximations") else "") for n in names]
            ax.set_xticks(range(len(names)), labels, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{preset} ({results['presets'][preset]['params'] / 1e6:.1f}M params): {title}", fontsize=9)
    fig.suptitle(f"world 2, gloo, {results['machine']['cpu']}, {results['date']}; ~ approximated (the backend's "
                 "closest form, its model state against the ZeRO-2 formula)", fontsize=9)
    fig.tight_layout()
    tmp = target.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, target)
    plt.close(fig)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: dict[str, Any]) -> str:
    """The Markdown block ``docs/benchmarks.md`` carries between its markers."""
    m = results["machine"]
    lines = [f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), Python "
             f"{m['python']}, torch {m['torch']}, DeepSpeed {m['deepspeed']}; world {results['world_size']} (gloo, "
             f"one thread per rank), {results['steps']} steps per run, {results['reps']} repetitions; "
             f"`{results['command'].strip()}`.", ""]
    for preset, data in results["presets"].items():
        lines += [f"**{preset}**: {data['params']:,} parameters, global batch {data['global_batch']} x "
                  f"{data['seq_len']} tokens; every run agrees with the first within {data['tolerance']:g} on "
                  f"losses and {data['norm_tolerance']:g} on grad norms: {'yes' if data['all_ok'] else 'NO'} (max "
                  f"loss deviation {data['max_loss_deviation']:.1e}, max grad-norm deviation "
                  f"{data['max_grad_norm_deviation']:.1e}).", "",
                  "| run | median step | step time ÷ native | model state/rank | ÷ formula | peak RSS in steps "
                  "| comm/step/rank | ÷ formula |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, run in data["runs"].items():
            if "error" in run:
                lines.append(f"| {name} | failed: {run['error']} |||||||")
                continue
            name += " ~" if run.get("approximations") else ""
            state = sum(run["model_state_bytes"].values())
            comm = round(sum(run["comm_bytes"].values()))
            lines.append(f"| {name} | {run['median_step_time_s'] * 1e3:.0f} ms | {_ratio(run['time_vs_native'])} "
                         f"| {format_bytes(state)} | {_ratio(run['state_vs_formula'])} "
                         f"| {format_bytes(round(run['steps_peak_rss_bytes']))} | {format_bytes(comm)} "
                         f"| {_ratio(run['comm_vs_formula'])} |")
        lines += [f"- ~ {name}: approximated ({', '.join(run['approximations'])}), the backend's closest form; "
                  f"model state and traffic ÷ the ZeRO-{run['formula_stage'] or run['stage']} formula"
                  for name, run in data["runs"].items() if run.get("approximations")]
        lines += [f"- skipped {s['backend']}/{s['label']}: {s['reason'].split(':')[0]}" for s in data["skipped"]]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def splice(doc: str, block: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
    """``doc`` with the text between the markers replaced by ``block``."""
    begin, end = markers
    head, found, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not (found and found_end):
        raise SystemExit(f"{DOC}: the markers {begin} and {end} are missing")
    return f"{head}{begin}\n{block}{end}{tail}"


def publish(results: dict[str, Any] | None, path: Path, table_of: Any, markers: tuple[str, str]) -> str:
    """Save ``results`` (when given) to ``path`` atomically, then rewrite the docs table between
    ``markers`` from what ``path`` holds; return the table."""
    if results is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, path)
    block = table_of(json.loads(path.read_text()))
    DOC.write_text(splice(DOC.read_text(), block, markers))
    return block


def preset_main(script: str, doc: str | None, *, steps: int, path: Path, table_of: Any, markers: tuple[str, str],
                measure: Any) -> int:
    """The command line of a per-preset benchmark: ``--steps``, ``--presets``, ``--render``;
    ``measure(presets, steps)`` gives the figures saved beside the date, machine and command."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--render", action="store_true", help="only rewrite the docs table")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    results = None if args.render else {
        "date": datetime.date.today().isoformat(), "machine": machine(), "steps": args.steps,
        "command": "python bench/" + Path(script).name + " " + " ".join(sys.argv[1:]),
        **measure(args.presets, args.steps)}
    print(publish(results, path, table_of, markers))
    return 0


def render(results: dict[str, Any]) -> None:
    """Rewrite the docs table and the plot from ``results``."""
    DOC.write_text(splice(DOC.read_text(), table(results)))
    plot(results, PLOT)


def main() -> int:
    from zerobridge.compare import plan, run_plan

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--render", action="store_true", help="only rewrite the docs table and plot")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    if args.render:
        render(json.loads(RESULTS.read_text()))
        return 0
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": "python bench/" + Path(__file__).name + " " + " ".join(sys.argv[1:]),
        "world_size": 2, "steps": args.steps, "reps": args.reps, "presets": {}}
    for preset in args.presets:
        shape = SHAPES[preset]
        reps: list[Comparison] = []
        for rep in range(args.reps):
            planned = plan(nproc=2, steps=args.steps, model=f"tiny-gpt:{preset}", **shape)
            print(f"== {preset}, repetition {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
            reps.append(run_plan(planned, progress=progress))
        results["presets"][preset] = {**summarise(reps), **shape}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, RESULTS)
    render(results)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
