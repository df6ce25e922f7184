"""What a process group costs to start, and a comparison run on each backend, forked from a zygote or not.

    python bench/cluster_start.py              # 4 starts and one tiny compare per backend, each way
    python bench/cluster_start.py --starts 8   # more starts

Side by side in one run: ``ZEROBRIDGE_CLUSTER_START=fork`` (workers forked from
a zygote that imported torch, ``zerobridge/harness/zygote.py``) against
``spawn`` (a fresh interpreter per worker, as before). Each mode runs in a
process of its own, so neither finds the other's zygote. Printed: the median
seconds of a 2-rank ``Cluster`` start (the first start of the fork mode pays
the zygote's own imports, and is shown apart), and the wall seconds of
``zerobridge compare --stages 3 --steps 2`` on each backend, with fork ÷ spawn.
The machine's load average is printed beside them: on a shared 2-core machine
only the ratios mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_STARTS = """
import json, sys, time
from zerobridge.harness.cluster import Cluster
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    with Cluster(2) as cluster:
        times.append(time.perf_counter() - start)
        assert cluster.run("zerobridge.harness.probes:all_reduce_sum", value=1.0) == [2.0, 2.0]
print(json.dumps(times))
"""


def _env(mode: str) -> dict[str, str]:
    return os.environ | {"ZEROBRIDGE_CLUSTER_START": mode, "DS_ACCELERATOR": "cpu",
                         "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def starts(mode: str, count: int) -> list[float]:
    """Seconds of ``count`` consecutive 2-rank ``Cluster`` starts in one fresh process."""
    out = subprocess.run([sys.executable, "-c", _STARTS, str(count)], env=_env(mode), cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    times: list[float] = json.loads(out.strip().splitlines()[-1])
    return times


def compare_runs(mode: str) -> dict[str, float]:
    """Wall seconds of each run of one ``zerobridge compare --stages 3 --steps 2`` over the three backends."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "compare.json"
        subprocess.run([sys.executable, "-m", "zerobridge.cli", "compare", "--stages", "3", "--steps", "2",
                        "--backends", "native", "fsdp", "deepspeed", "--json", str(report)],
                       env=_env(mode), cwd=ROOT, check=True, capture_output=True, text=True)
        runs = json.loads(report.read_text())["runs"]
    return {run["name"]: float(run["wall_s"]) for run in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=4, help="Cluster starts per mode (default 4)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    measured = {mode: (starts(mode, args.starts), compare_runs(mode)) for mode in ("spawn", "fork")}
    print(f"load average at the start: {load:.1f}; torch {__import__('torch').__version__}; {os.cpu_count()} CPUs")
    (spawned, spawn_runs), (forked, fork_runs) = measured["spawn"], measured["fork"]
    print(f"{'what':34} {'spawn s':>8} {'fork s':>8} {'fork/spawn':>10}")
    first, rest = forked[0], forked[1:] or forked
    print(f"{'Cluster(2) start, median':34} {statistics.median(spawned):8.2f} {statistics.median(rest):8.2f} "
          f"{statistics.median(rest) / statistics.median(spawned):10.2f}")
    print(f"{'  first fork start (zygote imports)':34} {'':8} {first:8.2f}")
    for name, spawn_s in spawn_runs.items():
        fork_s = fork_runs[name]
        print(f"{'compare run ' + name:34} {spawn_s:8.2f} {fork_s:8.2f} {fork_s / spawn_s:10.2f}")
    print(f"(each mode in its own process; finished {time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
