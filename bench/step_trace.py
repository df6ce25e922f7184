"""Where one training step's time goes, per phase, on each backend: the trace behind docs/benchmarks.md's
"DeepSpeed's step, traced".

    python bench/step_trace.py                                  # native and deepspeed, ZeRO-3, the 20M GPT
    python bench/step_trace.py --backends native fsdp deepspeed --stage 2

Each backend trains the same model on 2 gloo ranks (one ``torchrun`` each, one thread per rank): 3 warm-up
steps, then 6 measured ones. Rank 0 times each phase (forward, backward, clipping, ``optimizer.step()``,
``zero_grad``; the median step) and profiles the measured steps with cProfile: the collectives issued (calls
into c10d, under whatever Python wraps them) and the self time split by the package of the function:
``deepspeed/``, ``zerobridge/``, ``torch/`` Python, and C (kernels, collectives, autograd). The table prints
each backend's phases and their ratio to the first backend's, side by side.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

PHASES = ("forward", "backward", "clip", "step", "zero_grad")
WARMUP, MEASURED = 3, 6


def _package(filename: str) -> str:
    for name in ("deepspeed", "zerobridge", "torch"):
        if f"/{name}/" in filename:
            return name if name != "torch" else "torch (Python)"
    return "C (kernels, collectives, autograd)" if filename == "~" else "other Python"


def worker(backend: str, stage: int, model: str, out: Path, forward_prefetch: bool) -> None:
    """One rank of one backend's run (under torchrun); rank 0 writes its figures to ``out``. The spec is
    ``prepare(stage=N)``'s, with ``communication.forward_prefetch`` when asked."""
    import torch
    import torch.distributed as dist

    from zerobridge import api
    from zerobridge.compare.workload import resolve_model
    from zerobridge.models import shard
    from zerobridge.spec.presets import spec_for_stage

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    work = resolve_model(model, global_batch=8, seq_len=16)(0)
    spec = spec_for_stage(stage, work.model)
    if forward_prefetch:
        spec = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"forward_prefetch": True})})
    net, optimizer = api.prepare(work.model, work.optimizer(work.model), config=spec, backend=backend)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    profile = cProfile.Profile()

    def step(index: int, measured: bool) -> None:
        rows = tuple(shard(t, rank, world) for t in work.batch(index))
        dist.barrier()
        marks = [time.perf_counter()]
        loss = work.loss(net, rows)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        api.clip_grad_norm_(net, float("inf"))
        marks.append(time.perf_counter())
        optimizer.step()
        marks.append(time.perf_counter())
        optimizer.zero_grad()
        marks.append(time.perf_counter())
        if measured:
            for phase, start, stop in zip(PHASES, marks, marks[1:]):
                times[phase].append(stop - start)

    for index in range(WARMUP):
        step(index, False)
    profile.enable()
    for index in range(WARMUP, WARMUP + MEASURED):
        step(index, True)
    profile.disable()
    if rank == 0:
        self_time: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for (filename, _, name), (_, count, tottime, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
            self_time[_package(filename)] += tottime
            method = name.rstrip(">").rsplit(".", 1)[-1] if "_distributed_c10d." in name else ""
            if method in ("rank", "size"):
                calls["group queries (rank, size)"] += count
            elif method.startswith(("all", "reduce", "broadcast")):
                calls[method] += count
        total = sum(self_time.values())
        out.write_text(json.dumps({
            "median_ms": {p: 1000 * sorted(v)[len(v) // 2] for p, v in times.items()},
            "collectives_per_step": {k: v / MEASURED for k, v in sorted(calls.items())},
            "self_time_share": {k: v / total for k, v in self_time.most_common()}}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["native", "deepspeed"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--model", default="tiny-gpt:20m")
    parser.add_argument("--forward-prefetch", action="store_true",
                        help="gather the next unit before each unit's forward (communication.forward_prefetch)")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.stage, args.model, Path(args.worker[1]), args.forward_prefetch)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    torchrun = Path(sys.executable).with_name("torchrun")
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for backend in args.backends:
            out = Path(folder, f"{backend}.json")
            extra = ["--forward-prefetch"] if args.forward_prefetch else []
            subprocess.run([str(torchrun), "--nproc_per_node", "2", __file__, "--stage", str(args.stage),
                            "--model", args.model, *extra, "--worker", backend, str(out)], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            figures[backend] = json.loads(out.read_text())
    first = args.backends[0]
    print(f"{args.model}, ZeRO-{args.stage}, world 2 (gloo), rank 0, median of {MEASURED} steps after {WARMUP}: "
          f"`python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}`\n")
    print("| phase | " + " | ".join(f"{b} ms" for b in args.backends)
          + "".join(f" | {b} ÷ {first}" for b in args.backends[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(args.backends) - 1))
    for phase in (*PHASES, "total"):
        ms = {b: (sum(f["median_ms"].values()) if phase == "total" else f["median_ms"][phase])
              for b, f in figures.items()}
        print(f"| {phase} | " + " | ".join(f"{ms[b]:.1f}" for b in args.backends)
              + "".join(f" | {ms[b] / ms[first]:.2f}x" for b in args.backends[1:]) + " |")
    for backend, f in figures.items():
        issued = ", ".join(f"{k} {v:g}" for k, v in f["collectives_per_step"].items())
        share = ", ".join(f"{k} {v:.0%}" for k, v in f["self_time_share"].items())
        print(f"\n{backend}: collectives per step: {issued}; rank 0's self time: {share}")


if __name__ == "__main__":
    main()
