"""How close ``zerobridge plan`` comes to real runs, beside DeepSpeed's and Accelerate's estimators,
and how long it takes at 70B and 405B.

    python bench/plan.py                  # everything: about 25 min on 2 CPU cores; bench/results/plan.json
    python bench/plan.py --quick          # 20M GPT and tiny Llama at world 2: about 3 min
    python bench/plan.py --render         # rewrite docs/plan.md's block from the saved JSON
    python bench/plan.py --cli-only       # time the commands a user types, start to exit (about 2 min)

Accuracy: for every cell (model x world size x precision x candidate; the
100M GPT at world 2 only, as four real ranks of it do not fit 24 GiB) the plan
predicts a rank's peak live tensor bytes on fake tensors; then a real gloo
group of that world size (``Cluster``) trains the same two steps on real
tensors (``zerobridge.testing.plan_measure``) and rank 0's peak is measured
the same way (every storage counted as it is allocated and freed). The peak
is the highest of the forward, backward and step phases (preparing a meta
model, where values are drawn on the host one module at a time, is left
out). Beside it, what DeepSpeed's estimators (``estimate_zero2/3_model_states_mem_needs``,
the GPU figure; stages 2 and 3 only, no offload) and ``accelerate estimate-memory``
(its training figure for the dtype: no sharding, no activations) say for the
same cell, as a signed error against the measured peak.

Speed: the commands a user types (``CLI``), timed from start to exit as
subprocesses, with the CPU seconds of the command and its workers and the load
average before and after (the figures are wall clock: on a shared machine the
load says how far they are from a quiet one).

Scale: wall time and peak resident memory (this process and its workers) of
the whole plan of Llama-3-70B at world 64 over 8 nodes and Llama-3-405B at
world 128 over 16 nodes, and the error of extending a deep model from two
shallow depths (Llama-3-8B, 32 blocks, measured whole beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from backends import ROOT, machine, splice

from zerobridge.testing.estimators import accelerate_estimate, deepspeed_estimate, estimator_sizes

RESULTS = ROOT / "bench" / "results" / "plan.json"
DOC = ROOT / "docs" / "plan.md"
BEGIN, END = "<!-- bench/plan.py: begin -->", "<!-- bench/plan.py: end -->"
CELLS = ("zero0", "zero1", "zero2", "zero3", "zero0+ac", "zero1+ac", "zero2+ac", "zero3+ac")
OFFLOAD = ("zero2-offload", "zero3-offload")
SHAPES = {"tiny-gpt:20m": (2, 256), "tiny-gpt:100m": (1, 256), "tiny-llama": (2, 256)}
BIG = {"tiny-gpt:100m"}
"""Measured at world 2 only: four ranks of it at stage 0 outgrow this machine's 24 GiB."""


def _phase_peak(peaks: dict[str, int]) -> int:
    return max(v for k, v in peaks.items() if k != "setup")


def accuracy(models: list[str], worlds: list[int], precisions: list[str]) -> list[dict[str, Any]]:
    from zerobridge.harness.cluster import Cluster
    from zerobridge.planning import plan
    from zerobridge.planning.models import resolve_model

    rows = []
    for world in worlds:
        # glibc hands freed large blocks back at once, so the ranks' resident memory follows their live bytes
        with Cluster(world, timeout_s=1800, env={"MALLOC_MMAP_THRESHOLD_": str(2**20)}) as cluster:
            for model in models:
                if world > 2 and model in BIG:
                    continue
                micro, seq = SHAPES[model]
                source = resolve_model(model)
                params, largest = estimator_sizes(source.build())
                for precision in precisions:
                    result = plan(model, world_size=world, device_memory="1TiB", micro_batch=micro, seq_len=seq,
                                  precision=precision, workers=1)
                    names = CELLS + (OFFLOAD if world == 2 and precision == "fp32" else ())
                    for name in names:
                        row = result.row(name)
                        real = cluster.run("zerobridge.testing.plan_measure:measure", model=model,
                                           spec=row.spec.model_dump(mode="json"), micro_batch=micro, seq_len=seq)
                        measured = _phase_peak(real[0]["peaks"])
                        predicted = _phase_peak(row.peaks)
                        stage = row.spec.sharding.stage.value
                        ds = deepspeed_estimate(stage, params=params, largest=largest, world_size=world) \
                            if "offload" not in name else None
                        accel = accelerate_estimate(params, precision)
                        rows.append({"model": model, "world": world, "precision": precision, "candidate": name,
                                     "micro_batch": micro, "seq_len": seq, "measured": measured,
                                     "predicted": predicted, "error": predicted / measured - 1,
                                     "comm_equal": real[0]["comm_bytes"] == row.comm_by_kind,
                                     "deepspeed": ds, "deepspeed_error": None if ds is None else ds / measured - 1,
                                     "accelerate": accel, "accelerate_error": accel / measured - 1})
                        print(f"{model:<14} w{world} {precision} {name:<14} measured {measured / 2**20:9.1f} MiB "
                              f"predicted {rows[-1]['error']:+.4%}", file=sys.stderr)
    return rows


def _peak_rss_mib() -> float:
    """An upper bound on the plan's resident memory: this process's peak plus each worker at the
    largest worker's peak (``ru_maxrss`` of children is the largest one's)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + min(os.cpu_count() or 1, 4) * children) / 1024


QWEN2_7M = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
            "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 8192, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "torch_dtype": "float32"}
"""A ~6.5M-parameter Hugging Face config the suite does not build (issue 31's "7M HF config")."""
CLI = {"qwen2-7m": ["plan", "{qwen}", "--world-size", "2", "--device-memory", "1GiB", "--micro-batch", "2",
                    "--seq-len", "128"],
       "llama-3-70b": ["plan", "llama-3-70b", "--world-size", "64", "--nodes", "8", "--device-memory", "80GiB",
                       "--micro-batch", "1", "--seq-len", "4096"]}
CLI |= {f"{name} --flavor all": [*argv, "--flavor", "all"] for name, argv in list(CLI.items())}
"""The plans a user types, timed start to exit: every candidate of a small HF config, and issue 31's 70B plan,
on the native engine and on every flavor."""


def cli_times(checkout: str | None = None) -> dict[str, Any]:
    """Each ``CLI`` command run as the user runs it: wall seconds, CPU seconds (it and its workers), load;
    with zerobridge imported from ``checkout`` (a worktree of an earlier commit, also the working directory:
    ``python -m`` workers put it first on their path) when given."""
    # an earlier checkout's own entry point: the installed console script names this one's (cli.console)
    exe = [sys.executable, "-m", "zerobridge.cli"] if checkout else [str(Path(sys.executable).with_name("zerobridge"))]
    env = dict(os.environ, PYTHONPATH=checkout) if checkout else None
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder, "qwen2-7m", "config.json")
        config.parent.mkdir()
        config.write_text(json.dumps(QWEN2_7M))
        for name, argv in CLI.items():
            args = [a.replace("{qwen}", str(config)) for a in argv]
            load, before = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            done = subprocess.run([*exe, *args], check=True, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=checkout or folder)
            seconds = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            shown = " ".join("qwen2-7m/config.json" if a == str(config) else a for a in args)
            out[name] = {"command": f"zerobridge {shown}", "seconds": seconds, "cpu_seconds": cpu,
                         "load_before": load, "load_after": os.getloadavg()[0], "cores": os.cpu_count(),
                         "output": done.stdout}
            print(f"{name}: {seconds:.1f} s wall, {cpu:.1f} CPU-s, load {load:.1f}", file=sys.stderr)
    return out


def scale() -> dict[str, Any]:
    from zerobridge.planning import plan
    from zerobridge.planning.candidates import with_checkpointing
    from zerobridge.planning.fake_run import Run, run_once
    from zerobridge.planning.measure import SHALLOW
    from zerobridge.planning.measure import extend as _extend
    from zerobridge.planning.models import resolve_model
    from zerobridge.planning.report import render
    from zerobridge.spec.presets import spec_for_stage
    from zerobridge.translate.run_level import with_run_settings

    out: dict[str, Any] = {}
    for name, world, nodes in (("llama-3-70b", 64, 8), ("llama-3-405b", 128, 16)):
        start = time.perf_counter()
        result = plan(name, world_size=world, nodes=nodes, device_memory="80GiB", micro_batch=1, seq_len=4096)
        seconds = time.perf_counter() - start
        out[name] = {"seconds": seconds, "candidates": len(result.rows), "peak_rss_mib_upper_bound": _peak_rss_mib(),
                     "table": render(result)}
        print(f"{name}: {len(result.rows)} candidates in {seconds:.1f} s", file=sys.stderr)
    out["extension"] = {}
    run = Run(world_size=64, nodes=8, micro_batch=1, seq_len=4096)
    for name, labels in (("llama-3-8b", ("zero3", "zero3+ac", "zero2")), ("llama-3-70b", ("zero3+ac",))):
        source = resolve_model(name)
        template = source.build(2)
        specs = {"zero3": spec_for_stage(3, template),
                 "zero3+ac": with_checkpointing(spec_for_stage(3, template), template),
                 "zero2": spec_for_stage(2, template)}
        for label in labels:
            spec = with_run_settings(specs[label], precision="bf16").value
            low, high = (run_once(source, spec, run, layers=d) for d in SHALLOW)
            whole = run_once(source, spec, run)
            extended = _extend(low, high, SHALLOW, source.layers or 0)
            out["extension"][f"{name} {label}"] = {
                "whole": _phase_peak(whole.peaks), "extended": _phase_peak(extended.peaks),
                "error": _phase_peak(extended.peaks) / _phase_peak(whole.peaks) - 1,
                "comm_error": max(abs(extended.comm_bytes.get(k, 0) / v - 1)
                                  for k, v in whole.comm_bytes.items() if v)}
            print(f"{name} {label}: extended {out['extension'][f'{name} {label}']['error']:+.3%}",
                  file=sys.stderr)
    from zerobridge.explain import explain
    stage3 = explain(spec_for_stage(3), params=7_500_000_000, world_size=64).model_state_bytes
    stage0 = explain(spec_for_stage(0), params=7_500_000_000, world_size=64).model_state_bytes
    out["zero_paper"] = {"stage0": stage0, "stage3": stage3, "stage0_error": stage0 / 120e9 - 1,
                         "stage3_error": stage3 / 1.9e9 - 1}
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def table(data: dict[str, Any]) -> str:
    """The Markdown block docs/plan.md carries between its markers."""
    m = data["machine"]
    lines = [f"Measured {data['date']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, DeepSpeed "
             f"{m['deepspeed']}: `{data['command'].strip()}`", "",
             "| model | world | dtype | candidate | measured peak | plan | DeepSpeed estimator | "
             "accelerate estimate |", "|---|---|---|---|---|---|---|---|"]
    for r in data.get("accuracy", []):
        lines.append(f"| {r['model']} | {r['world']} | {r['precision']} | {r['candidate']} | "
                     f"{r['measured'] / 2**20:.1f} MiB | {r['error']:+.2%} | {_pct(r['deepspeed_error'])} | "
                     f"{_pct(r['accelerate_error'])} |")
    acc = data.get("accuracy", [])
    if acc:
        worst = max(abs(r["error"]) for r in acc)
        lines.append(f"\n{len(acc)} cells; largest plan error {worst:.4%}; collective bytes equal in "
                     f"{sum(r['comm_equal'] for r in acc)} of {len(acc)}")
    s = data.get("scale", {})
    if "scale_command" in data:
        lines.append(f"\nScale figures: `{data['scale_command'].strip()}` on a quiet machine.")
    for name in ("llama-3-70b", "llama-3-405b"):
        if name in s:
            bound = s[name]["peak_rss_mib_upper_bound"]
            lines.append(f"\n{name}: {s[name]['candidates']} candidates; peak RSS (upper bound: this process + "
                         f"every worker at the largest one's peak) {bound:.0f} MiB")
    if "cli" in data:
        base = data.get("cli_baseline", {})
        lines += ["", "The commands a user types, start to exit (`python bench/plan.py --cli-only"
                  + (f" --baseline <worktree of {base['commit']}>" if base else "")
                  + f"`, {data['cli_date']}; wall clock, the load average beside each):", "",
                  "| command | code | wall | CPU (with workers) | wall ÷ the earlier code's | load before / after |",
                  "|---|---|---|---|---|---|"]
        for name, c in data["cli"].items():
            rows = [(base["commit"], base["figures"][name])] if name in base.get("figures", {}) else []
            for code, f in [*rows, ("this", c)]:
                ratio = f"{f['seconds'] / rows[0][1]['seconds']:.2f}" if rows and code == "this" else ""
                lines.append(f"| `{c['command']}` | {code} | {f['seconds']:.1f} s | {f['cpu_seconds']:.1f} s | "
                             f"{ratio} | {f['load_before']:.1f} / {f['load_after']:.1f} on {f['cores']} cores |")
    shown = data.get("cli", {}).get("llama-3-70b", {}).get("output") or s.get("llama-3-70b", {}).get("table")
    if shown:  # what the command printed when it was timed, else what the scale run's plan rendered
        lines += ["", "`zerobridge plan llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --micro-batch 1 "
                  "--seq-len 4096`:", "", "```", shown.rstrip(), "```", ""]
    for label, e in s.get("extension", {}).items():
        lines.append(f"{label}: extended {e['extended'] / 1e9:.2f} GB, whole {e['whole'] / 1e9:.2f} GB "
                     f"({e['error']:+.3%}); collective bytes off by at most {e['comm_error']:.1e}")
    if "zero_paper" in s:
        z = s["zero_paper"]
        lines.append(f"ZeRO paper 7.5B on 64 GPUs: stage 0 {z['stage0'] / 1e9:.1f} GB ({z['stage0_error']:+.2%} "
                     f"of 120 GB), stage 3 {z['stage3'] / 1e9:.3f} GB ({z['stage3_error']:+.2%} of 1.9 GB)")
    return "\n".join(lines) + "\n"


def save(data: dict[str, Any]) -> None:
    """Write ``data`` to ``RESULTS`` atomically, redraw the docs table from it and print it."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(RESULTS)
    DOC.write_text(splice(DOC.read_text(), table(data), (BEGIN, END)))
    print(table(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20M GPT and tiny Llama at world 2, no scale runs")
    parser.add_argument("--render", action="store_true", help="print the tables from bench/results/plan.json")
    parser.add_argument("--scale-only", action="store_true",
                        help="rerun only the 70B/405B timings and the depth check into the saved JSON (run it on "
                             "a quiet machine: the timings are wall clock)")
    parser.add_argument("--cli-only", action="store_true",
                        help="time only the commands a user types (CLI) into the saved JSON and the docs")
    parser.add_argument("--baseline", metavar="DIR",
                        help="with --cli-only: time the same commands first on a worktree of an earlier commit")
    args = parser.parse_args()
    if args.render:
        data = json.loads(RESULTS.read_text())
        DOC.write_text(splice(DOC.read_text(), table(data), (BEGIN, END)))
        print(table(data))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.cli_only:
        data = json.loads(RESULTS.read_text())
        if args.baseline:
            commit = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()
            data["cli_baseline"] = {"commit": commit, "figures": cli_times(args.baseline)}
        data["cli"], data["cli_date"] = cli_times(), datetime.date.today().isoformat()
        save(data)
        return
    if args.scale_only:
        data = json.loads(RESULTS.read_text())
        data["scale"] = scale()
        data["scale_command"] = "python bench/plan.py " + " ".join(sys.argv[1:])
        save(data)
        return
    data: dict[str, Any] = {"machine": machine(), "date": datetime.date.today().isoformat(),
                            "command": "python bench/plan.py " + " ".join(sys.argv[1:])}
    if args.quick:
        data["accuracy"] = accuracy(["tiny-gpt:20m", "tiny-llama"], [2], ["fp32", "bf16"])
    else:
        data["accuracy"] = accuracy(list(SHAPES), [2, 4], ["fp32", "bf16"])
        data["scale"] = scale()
    save(data)


if __name__ == "__main__":
    main()
