"""The native engine against torch FSDP2 where users push it: a frozen LoRA base, and many small units.

    python bench/engine_scale.py             # about 5 min on 2 cores
    python bench/engine_scale.py --render    # rewrite the docs table from the saved JSON

Both measurements run the two backends on one 2-process gloo group, one after
the other, with the same model, spec and batches:

1. LoRA-style frozen base at ZeRO-3 (``zerobridge.testing.lora``): eight
   frozen 1024 x 1024 layers with rank-4 trainable adapters, one unit per
   block. Peak bytes of every live tensor storage (found through the garbage
   collector: the same measure for both backends) during backward, above what
   was alive when backward started, against two blocks' parameters.
2. Many small units (``zerobridge.testing.many_units``): blocks of 8 linear
   layers, 64, 128 and 256 modules, one unit per module (what DeepSpeed
   configs become) and one per block. Median step time after two warm-up steps,
   the slowest rank's.

Writes ``bench/results/engine_scale.json`` and the table between the markers in
``docs/benchmarks.md`` (a test checks the table against the JSON). Asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

from backends import ROOT, machine, publish, splice  # noqa: F401  (splice: tests render the block)

from zerobridge.explain import format_bytes

BEGIN, END = "<!-- bench/engine_scale.py: begin -->", "<!-- bench/engine_scale.py: end -->"
RESULTS = ROOT / "bench" / "results" / "engine_scale.json"
DOC = ROOT / "docs" / "benchmarks.md"
MODULES = (64, 128, 256)


def measure() -> dict[str, Any]:
    from zerobridge.harness.cluster import Cluster
    from zerobridge.testing.many_units import PER_BLOCK

    out: dict[str, Any] = {"lora": {}, "units": []}
    with Cluster(2) as cluster:
        for backend in ("native", "fsdp"):
            run = cluster.run("zerobridge.testing.lora:run_lora", backend=backend, width=1024, steps=3)[0]
            out["lora"][backend] = run
            print(f"lora {backend}: {run['peak_backward_bytes']} bytes", file=sys.stderr, flush=True)
        for modules in MODULES:
            for wrap in ("module", "block"):
                row: dict[str, Any] = {"modules": modules, "wrap": wrap}
                for backend in ("native", "fsdp"):
                    times = cluster.run("zerobridge.testing.many_units:step_times", blocks=modules // PER_BLOCK,
                                        wrap=wrap, backend=backend)[0]
                    row[backend] = statistics.median(times[2:])
                out["units"].append(row)
                print(f"{modules} modules per {wrap}: native {row['native'] * 1e3:.1f} ms, "
                      f"fsdp {row['fsdp'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    m, lora = results["machine"], results["lora"]
    native, fsdp = lora["native"], lora["fsdp"]
    lines = [f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}; world 2 (gloo); "
             f"`{results['command'].strip()}`.", "",
             "| LoRA base at ZeRO-3 (8 frozen 1024 x 1024 blocks) | peak live bytes in backward | ÷ FSDP2 "
             "| ÷ two blocks' parameters |", "|---|---|---|---|"]
    for name, run in (("native", native), ("FSDP2", fsdp)):
        lines.append(f"| {name} | {format_bytes(run['peak_backward_bytes'])} "
                     f"| {run['peak_backward_bytes'] / fsdp['peak_backward_bytes']:.2f} "
                     f"| {run['peak_backward_bytes'] / (2 * run['block_bytes']):.2f} |")
    lines += ["", "| modules | units | native step | FSDP2 step | native ÷ FSDP2 | native ÷ previous size |",
              "|---|---|---|---|---|---|"]
    previous: dict[str, float] = {}
    for row in results["units"]:
        growth = f"{row['native'] / previous[row['wrap']]:.2f}" if row["wrap"] in previous else "-"
        previous[row["wrap"]] = row["native"]
        lines.append(f"| {row['modules']} | one per {row['wrap']} | {row['native'] * 1e3:.1f} ms "
                     f"| {row['fsdp'] * 1e3:.1f} ms | {row['native'] / row['fsdp']:.2f} | {growth} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", action="store_true", help="only rewrite the docs table")
    args = parser.parse_args()
    results = None if args.render else {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": "python bench/" + Path(__file__).name + " " + " ".join(sys.argv[1:]), **measure()}
    print(publish(results, RESULTS, table, (BEGIN, END)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
