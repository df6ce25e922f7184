"""Host overhead, counted: the aten ops one training step dispatches on rank 0, per engine and ZeRO stage
(the tiny GPT at 20M parameters, world 2, gloo), and per block of a ``zerobridge plan`` fake step.

    python bench/host_overhead.py             # about 3 min on 2 cores
    python bench/host_overhead.py --render    # rewrite the docs table from the saved JSON

On a GPU every dispatched op is at least one kernel launch, so for small models this count, not the
bytes, sets the step time; here it is exact and repeatable whatever else the machine does (a count, not a
timing). Each engine's second step is counted (``zerobridge.testing.op_count.step_ops``: forward,
backward, ``zerobridge.clip_grad_norm_``, AdamW, ``zero_grad``) in one 2-process group: the native
engine, torch FSDP2 (``backend="fsdp"``; its closest form of stages 0 and 1, which it cannot run
exactly) and DeepSpeed (``backend="deepspeed"``). The plan row counts ``fake_step_ops`` for Llama-3-8B
shapes at ZeRO-3 on a fake group of 8, built 2 and 3 blocks deep: the difference is the cost of one
block. Writes ``bench/results/host_overhead.json`` and the table between the markers in
``docs/benchmarks.md`` (``tests/test_docs.py`` checks that the table matches the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from backends import ROOT, splice

BEGIN, END = "<!-- bench/host_overhead.py: begin -->", "<!-- bench/host_overhead.py: end -->"
RESULTS = ROOT / "bench" / "results" / "host_overhead.json"
DOC = ROOT / "docs" / "benchmarks.md"
BACKENDS = ("native", "fsdp", "deepspeed")
STAGES = (0, 1, 2, 3)
PRESET = "20m"
PLAN_MODEL = "llama-3-8b"


def measure() -> dict[str, Any]:
    from zerobridge.harness.cluster import Cluster
    from zerobridge.testing.op_count import fake_step_ops

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    steps: dict[str, dict[str, int]] = {}
    with Cluster(2, timeout_s=900) as cluster:
        for stage in STAGES:
            for backend in BACKENDS:
                found = cluster.run("zerobridge.testing.op_count:step_ops", backend=backend, stage=stage,
                                    preset=PRESET, seq_len=128)[0]
                steps.setdefault(str(stage), {})[backend] = found["total"]  # type: ignore[index]
                print(f"ZeRO-{stage} {backend}: {found['total']} ops", flush=True)  # type: ignore[index]
    two, three = fake_step_ops(PLAN_MODEL, 3, 2), fake_step_ops(PLAN_MODEL, 3, 3)
    block = {name: three.get(name, 0) - two.get(name, 0) for name in set(two) | set(three)}
    device = block.get("prim.device", 0)
    return {"preset": PRESET, "world_size": 2, "steps": steps,
            "plan": {"model": PLAN_MODEL, "stage": 3, "world_size": 8, "ops_per_block": sum(block.values()) - device,
                     "device_queries_per_block": device}}


def table(results: dict[str, Any]) -> str:
    rows = ["| ZeRO stage | native | FSDP2 | DeepSpeed | native / FSDP2 | native / DeepSpeed |",
            "|---|---|---|---|---|---|"]
    for stage, by in results["steps"].items():
        rows.append(f"| {stage} | {by['native']:,} | {by['fsdp']:,} | {by['deepspeed']:,} | "
                    f"{by['native'] / by['fsdp']:.2f}x | {by['native'] / by['deepspeed']:.2f}x |")
    plan = results["plan"]
    return "\n".join(rows) + (
        f"\n\nAten ops one training step dispatches on rank 0 (the tiny GPT at {results['preset']}, world "
        f"{results['world_size']}; FSDP2 at stages 0 and 1 is its closest form). A `zerobridge plan` fake step "
        f"({plan['model']} shapes, ZeRO-{plan['stage']}, fake group of {plan['world_size']}): "
        f"**{plan['ops_per_block']:,} aten ops per block**, plus {plan['device_queries_per_block']:,} `prim.device` "
        "queries that fake tensors answer in Python (autograd asks one per gradient; no kernel).")


def render(results: dict[str, Any]) -> None:
    DOC.write_text(splice(DOC.read_text(encoding="utf-8"), table(results), (BEGIN, END)), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", action="store_true", help="only rewrite the docs table from the saved JSON")
    args = parser.parse_args()
    if args.render:
        results = json.loads(RESULTS.read_text(encoding="utf-8"))
    else:
        results = measure()
        RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    render(results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
