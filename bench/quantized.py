"""Quantized collectives on the native engine: bytes per step and losses beside the exact run.

    python bench/quantized.py                 # 20M GPT, bf16, stage 3, world 4 as 2 nodes x 2: about 25 min
    python bench/quantized.py --steps 40      # a quicker look
    python bench/quantized.py --render        # rewrite docs/quantized.md's block from the saved JSON
    python bench/quantized.py --only "exact, fp32 reductions"   # (re)measure rows into the saved JSON

Every configuration trains the built-in 20M GPT (``tiny-gpt:20m``: global
batch 8 x 128 tokens, AdamW at 3e-3, clipping at 1.0, the same seed and
batches) for ``--steps`` steps on 4 gloo processes laid out as 2 nodes of 2
(``LOCAL_WORLD_SIZE=2``: a quantized reduction runs in two hops), each in a
fresh process group, with the loop ``zerobridge compare`` uses. Per
configuration: the bytes one rank moves per step by collective (the engine's
count of what travels: codes and scales for quantized payloads), beside
``zerobridge explain``'s formula for the same spec, the ratio of each
collective's bytes to the exact bf16 run's, the final loss (mean of the
last 10 steps) against the exact run's, and the median step time against
the exact run's. On CPU the step-time ratio mostly measures the cost of
encoding and decoding on 2 cores, not a network: it says nothing about a
GPU cluster, where qwZ/qgZ trade that cost for inter-node bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from typing import Any

from backends import ROOT, machine, splice

RESULTS = ROOT / "bench" / "results" / "quantized.json"
DOC = ROOT / "docs" / "quantized.md"
BEGIN, END = "<!-- bench/quantized.py: begin -->", "<!-- bench/quantized.py: end -->"
WORLD, PER_NODE = 4, 2
CONFIGS: dict[str, dict[str, str | int]] = {
    "exact (bf16)": {},
    "exact, fp32 reductions": {"reduce_dtype": "fp32"},
    "qwZ (int8 gathers)": {"param_gather": "int8"},
    "qgZ (int4 reductions)": {"grad_reduce": "int4"},
    "qgZ, blocks of 2048": {"grad_reduce": "int4", "grad_block_size": 2048},
    "qwZ + qgZ": {"param_gather": "int8", "grad_reduce": "int4"},
    "fp8 gathers": {"param_gather": "fp8"},
}


NOISE = "exact, fp32 reductions"
"""Not quantized: the exact run with its gradients summed in fp32 instead of bf16. How far a change of
rounding alone moves the final loss of this run, the yardstick for the quantized rows."""


def _spec(wire: dict[str, str | int]) -> Any:
    from zerobridge.models import tiny_gpt
    from zerobridge.spec import StrategySpec
    from zerobridge.spec.presets import spec_for_stage

    data = spec_for_stage(3, tiny_gpt("tiny")).model_dump(mode="json")
    wire = dict(wire)
    reduce = wire.pop("reduce_dtype", "bf16")
    data["precision"] = {"param_dtype": "bf16", "master_dtype": "fp32", "reduce_dtype": reduce}
    data["communication"]["wire"] = wire  # grad_block_size 128 unless a row says otherwise
    return StrategySpec.model_validate(data)


def measure(steps: int, only: list[str] | None = None) -> dict[str, Any]:
    from zerobridge.explain import explain
    from zerobridge.harness.cluster import Cluster
    from zerobridge.models import tiny_gpt

    params = tiny_gpt("20m").num_params()
    out: dict[str, Any] = {"params": params, "steps": steps, "world": WORLD, "ranks_per_node": PER_NODE, "runs": {}}
    for name, wire in CONFIGS.items():
        if only is not None and name not in only:
            continue
        spec = _spec(wire)
        with Cluster(WORLD, timeout_s=7200) as cluster:
            records = cluster.run("zerobridge.testing.quantized:train_on_nodes", ranks_per_node=PER_NODE,
                                  model="tiny-gpt:20m", global_batch=8, seq_len=128, choice={"config": spec},
                                  backend="native", steps=steps, seed=0, clip=1.0, allow_approximate=False)
        rank0 = records[0]
        told = explain(spec, params=params, world_size=WORLD, local_world_size=PER_NODE)
        formula: dict[str, int] = {}
        for row in told.comms:
            kind = row.collective.replace("-", "_")
            formula[kind] = formula.get(kind, 0) + row.bus_bytes_per_step
        out["runs"][name] = {"wire": wire, "losses": rank0.losses, "step_times": rank0.step_times,
                             "comm_bytes": rank0.comm_bytes[-1], "formula_bytes": formula}
        print(f"{name}: final loss {statistics.mean(rank0.losses[-10:]):.4f}, {rank0.comm_bytes[-1]}",
              file=sys.stderr)
    return out


def table(data: dict[str, Any]) -> str:
    """The Markdown block docs/quantized.md carries between its markers."""
    m = data["machine"]
    runs = data["runs"]
    exact = runs["exact (bf16)"]
    base_loss = statistics.mean(exact["losses"][-10:])
    base_time = statistics.median(exact["step_times"][1:])
    gather0 = exact["comm_bytes"].get("all_gather", 0)
    reduce0 = exact["comm_bytes"].get("reduce_scatter", 0)
    lines = [f"Measured {data['date']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}: "
             f"`{data['command'].strip()}`; {data['params']:,}-parameter GPT, bf16, stage 3, world "
             f"{data['world']} as {data['world'] // data['ranks_per_node']} nodes x {data['ranks_per_node']}, "
             f"{data['steps']} steps.", "",
             "| run | parameter gathers / step | ÷ exact | gradient reduction / step | ÷ exact | = explain | "
             "final loss | vs exact | step time ÷ exact |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        c = run["comm_bytes"]
        gather = c.get("all_gather", 0)
        grads = c.get("reduce_scatter", 0) + c.get("all_to_all", 0)
        f = run["formula_bytes"]
        told = f.get("all_gather", 0) + f.get("reduce_scatter", 0) + f.get("all_to_all", 0)
        moved = gather + grads
        loss = statistics.mean(run["losses"][-10:])
        lines.append(f"| {name} | {gather / 1e6:.2f} MB | {gather / gather0:.3f} | {grads / 1e6:.2f} MB | "
                     f"{grads / reduce0:.3f} | {moved / told:.4f} | {loss:.4f} | {loss / base_loss - 1:+.2%} | "
                     + ("measured apart |" if "apart" in run else
                        f"{statistics.median(run['step_times'][1:]) / base_time:.2f} |"))
    apart = [f"`{name}`: {run['apart']}" for name, run in runs.items() if "apart" in run]
    if apart:
        lines += ["", "Rows measured apart from the others (losses and bytes are deterministic: the same seed, "
                  "batches and code give the same figures in any run; step times are not side by side): "
                  + "; ".join(apart) + "."]
    lines += ["", "Loss every 25 steps (mean over the world's batch):", "",
              "| step | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for step in range(0, data["steps"], 25):
        lines.append(f"| {step} | " + " | ".join(f"{r['losses'][step]:.4f}" for r in runs.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), metavar="ROW",
                        help="measure these rows into the saved JSON (its other rows stay); their step times are "
                             "not side by side with the saved exact run's, so the table leaves that ratio out")
    args = parser.parse_args()
    if not args.render:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        command = shlex.join(["python", "bench/quantized.py", *sys.argv[1:]])
        if args.only:
            data = json.loads(RESULTS.read_text())
            if data["steps"] != args.steps:
                sys.exit(f"the saved run has {data['steps']} steps: pass --steps {data['steps']}")
            for name, run in measure(args.steps, args.only)["runs"].items():
                data["runs"][name] = {**run, "apart": f"{datetime.date.today().isoformat()}: {command}"}
            data["runs"] = {name: data["runs"][name] for name in CONFIGS if name in data["runs"]}
        else:
            data = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command,
                    **measure(args.steps)}
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(RESULTS)
    data = json.loads(RESULTS.read_text())
    DOC.write_text(splice(DOC.read_text(), table(data), (BEGIN, END)))
    print(table(data))


if __name__ == "__main__":
    main()
