"""DeepSpeed's peak under the buckets ``convert --to deepspeed`` wrote before issue 31 (DeepSpeed's
5e8/5e7-element defaults) and under the sizes it writes with ``--model`` now, beside the FSDP2
backend's peak, for one Accelerate FSDP config of the corpus on the tiny Llama: the figure in
docs/translators.md.

    python bench/deepspeed_buckets.py     # about a minute on 2 cores; needs ../shared/corpus

World 2 on CPU (gloo), 2 x 128 tokens per rank, two AdamW steps: peaks are the live tensor bytes
of the training phases on the busier rank, counted by ``zerobridge.testing.flavor_peaks`` (the
plan's ``StorageTracker``). Both DeepSpeed configs run in one launch, the FSDP2 run in another.
Writes ``bench/results/deepspeed_buckets.json``. A script, not a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerobridge.harness.cluster import Cluster
from zerobridge.load import load_spec
from zerobridge.planning.models import resolve_model
from zerobridge.runtime.wrap_units import bucket_sizes
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.run_level import with_run_settings

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO.parent / "shared" / "corpus" / "accelerate" / \
    "huggingface__accelerate__examples__config_yaml_templates__fsdp.yaml"
MODEL, WORLD, MICRO_BATCH, SEQ_LEN = "tiny-llama", 2, 2, 128
OLD = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
       "stage3_prefetch_bucket_size": 50_000_000}
"""What the writer put in place of "per_unit" before: DeepSpeed's defaults."""
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}


def main() -> None:
    os.environ.update(ENV)
    spec = with_run_settings(load_spec(SOURCE).value, world_size=WORLD, micro_batch=MICRO_BATCH, accumulation=1,
                             clip=1.0).value
    spec = spec.model_copy(update={"wrapping": spec.wrapping.model_copy(update={"layer_classes": "auto"})})
    new = write_deepspeed(spec, bucket_sizes(resolve_model(MODEL).build(), spec)).value
    new.update(zero_allow_untested_optimizer=True, steps_per_print=2**62)
    old = new | {"zero_optimization": new["zero_optimization"] | OLD}
    run = {"model": MODEL, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN}
    with Cluster(WORLD, timeout_s=600, env=ENV) as cluster:
        ds: list[Any] = cluster.run("zerobridge.testing.flavor_peaks:deepspeed_peaks",
                                    configs={"old": old, "new": new}, **run)
    with Cluster(WORLD, timeout_s=600) as cluster:
        fsdp: list[Any] = cluster.run("zerobridge.testing.flavor_peaks:fsdp_peaks",
                                      specs={"fsdp2": spec.model_dump(mode="json")}, **run)
    reference = max(rank["fsdp2"]["train"] for rank in fsdp)
    rows = {"fsdp2": reference} | {name: max(rank[name]["train"] for rank in ds) for name in ("old", "new")}
    result = {"source": SOURCE.name, **run, "world_size": WORLD,
              "buckets": {"old": OLD, "new": {k: new["zero_optimization"][k] for k in OLD}},
              "peak_bytes": rows, "ratio_to_fsdp2": {k: v / reference for k, v in rows.items()}}
    out = REPO / "bench" / "results" / "deepspeed_buckets.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, peak in rows.items():
        print(f"{name:>6}  {peak / 2**20:8.1f} MiB  {peak / reference:6.2f}x FSDP2")


if __name__ == "__main__":
    main()
