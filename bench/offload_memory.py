"""Peak memory per rank of the 98M-parameter tiny GPT with AdamW, with and without
NVMe offload, 2 ranks (gloo on CPU).

    python bench/offload_memory.py                       # writes bench/results/offload_memory.json
    python bench/offload_memory.py --steps 2 --configs "stage 3" "stage 3, optimizer nvme"

Each configuration runs in a fresh 2-process group (``Cluster``), so peaks do
not mix. Per rank: the model is built and prepared, the peak-RSS mark is reset
(``/proc/self/clear_refs``), a few training steps run (global batch 4 of
``--seq-len`` tokens, clipping, AdamW), and then we read the peak RSS of those
steps (``VmHWM``), the process's lifetime peak (``ru_maxrss``, which includes
building the whole model before sharding it) and ``zerobridge.stats``. The
expected optimizer-state bytes are AdamW's two fp32 moments on this rank's
shard: 8 P / N.

Workers start with ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (``--default-malloc``
leaves glibc's adaptive threshold): glibc then hands large freed blocks back to
the system, so RSS follows live memory instead of keeping freed heap around.
Bytes written to swap files sit in the kernel's page cache, which RSS does not
count (the kernel can drop it once written). It is a script, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "offload_memory.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "stage 3": {"stage": 3},
    "stage 3, optimizer nvme": {"stage": 3, "optimizer": "nvme"},
    "stage 3, optimizer + parameters nvme": {"stage": 3, "optimizer": "nvme", "parameters": "nvme"},
    "stage 2": {"stage": 2},
    "stage 2, optimizer nvme": {"stage": 2, "optimizer": "nvme"},
}
MIB = 1024 * 1024


def measure(*, config: dict[str, Any], nvme_path: str, steps: int, seq_len: int, sub_group_size: int) -> dict[str, Any]:
    """On every rank: build, prepare and train the 100m GPT; memory figures of this rank."""
    import torch.distributed as dist

    import zerobridge
    from zerobridge.compare.worker import peak_rss_bytes, reset_peak_rss, rss_bytes
    from zerobridge.models import no_weight_decay, shard, tiny_gpt
    from zerobridge.spec import OffloadSpec
    from zerobridge.spec.presets import spec_for_stage

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = spec_for_stage(config["stage"])
    tiers: dict[str, Any] = {"sub_group_size": sub_group_size}
    for tier in ("optimizer", "parameters"):
        if config.get(tier) == "nvme":
            tiers[tier] = {"device": "nvme", "nvme_path": nvme_path}
    spec = spec.model_copy(update={"offload": OffloadSpec.model_validate(tiers)})
    model = tiny_gpt("100m", seed=0)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    model = zerobridge.prepare(model, config=spec)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if not no_weight_decay(n)], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if no_weight_decay(n)], "weight_decay": 0.0}],
                                  lr=3e-4)
    gc.collect()
    rest_before = rss_bytes()
    reset = reset_peak_rss()
    losses, seconds = [], []
    for step in range(steps):
        start = time.perf_counter()
        tokens = torch.randint(vocab, (4, seq_len + 1), generator=torch.Generator().manual_seed(step))
        x, y = (shard(t, rank, world) for t in (tokens[:, :-1], tokens[:, 1:]))
        loss = model(x, targets=y)
        loss.backward()
        zerobridge.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    stats = zerobridge.stats(model)
    return {"rank": rank, "params": params, "shards": world, "losses": losses, "step_seconds": seconds,
            "rss_after_prepare": rest_before, "rss_after_training": rss_bytes(),
            "peak_rss_training": peak_rss_bytes() if reset else None,
            "peak_rss_lifetime": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "tier_bytes": stats["tier_bytes"], "param_bytes": stats["param_bytes"],
            "grad_bytes": stats["grad_bytes"], "optimizer_bytes": stats["optimizer_bytes"]}


def run(names: list[str], *, steps: int, seq_len: int, sub_group_size: int, nvme_root: str) -> list[dict[str, Any]]:
    from zerobridge.harness.cluster import Cluster

    rows = []
    for name in names:
        path = tempfile.mkdtemp(prefix="offload-bench-", dir=nvme_root)
        started = time.perf_counter()
        try:
            with Cluster(2, timeout_s=600) as cluster:
                ranks: Any = cluster.run("offload_memory:measure", config=CONFIGS[name], nvme_path=path,
                                         steps=steps, seq_len=seq_len, sub_group_size=sub_group_size)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        rows.append({"config": name, "seconds": round(time.perf_counter() - started, 1), "ranks": ranks})
        print(f"{name}: peak during training {[r['peak_rss_training'] // MIB for r in ranks]} MiB", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per configuration, rank-mean MiB and the ratio to the same stage without offload."""
    def mean(row: dict[str, Any], key: str) -> float:
        return sum(r[key] for r in row["ranks"]) / len(row["ranks"]) / MIB

    base = {row["config"].split(",")[0]: row for row in rows if "," not in row["config"]}
    lines = ["| configuration | peak RSS, training (MiB) | ratio | lifetime peak (MiB) | RSS at rest (MiB) "
             "| drop vs no offload (MiB) | 8P/N expected (MiB) | tier bytes device / host / nvme (MiB) | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        first = row["ranks"][0]
        ref = base.get(row["config"].split(",")[0], row)
        peak, ref_peak = mean(row, "peak_rss_training"), mean(ref, "peak_rss_training")
        expected = 8 * first["params"] / first["shards"] / MIB
        tiers = " / ".join(f"{sum(r['tier_bytes'][t] for r in row['ranks']) / len(row['ranks']) / MIB:.0f}"
                           for t in ("device", "host", "nvme"))
        per_step = sum(sum(r["step_seconds"][1:]) / max(1, len(r["step_seconds"]) - 1) for r in row["ranks"]) / 2
        lines.append(f"| {row['config']} | {peak:.0f} | {peak / ref_peak:.2f} | {mean(row, 'peak_rss_lifetime'):.0f} "
                     f"| {mean(row, 'rss_after_training'):.0f} | {ref_peak - peak:.0f} | {expected:.0f} | {tiers} "
                     f"| {per_step:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sub-group-size", type=int, default=4_000_000, help="offload.sub_group_size (elements)")
    parser.add_argument("--nvme-root", default=tempfile.gettempdir(), help="a directory on a real disk")
    parser.add_argument("--default-malloc", action="store_true", help="keep glibc's adaptive mmap threshold")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1024 * 1024)  # inherited by the spawned ranks
    started = time.perf_counter()
    rows = run(args.configs, steps=args.steps, seq_len=args.seq_len, sub_group_size=args.sub_group_size,
               nvme_root=args.nvme_root)
    command = "python bench/offload_memory.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              f"{platform.system()} {platform.release()}", "torch": torch.__version__,
              "steps": args.steps, "seq_len": args.seq_len, "global_batch": 4, "world_size": 2,
              "sub_group_size": args.sub_group_size, "malloc_mmap_threshold": None if args.default_malloc else MIB,
              "total_seconds": round(time.perf_counter() - started, 1), "rows": rows, "table": table(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(result["table"])
    print(f"wrote {out} in {result['total_seconds']} s")


if __name__ == "__main__":
    main()
