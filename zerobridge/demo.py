"""``zerobridge demo``: the translation walkthrough (``make demo`` runs ``zerobridge compare``).

It takes the bundled ZeRO-3 offload strategy (``strategies/zero3-offload.toml``),
explains it for a 7B model on 64 ranks, converts it to FSDP2 with the report,
and checks the conversion back through DeepSpeed JSON. No process starts.
"""

from __future__ import annotations

import json

from zerobridge.diff import diff_specs
from zerobridge.explain import explain
from zerobridge.registry import resolve
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.formats import write
from zerobridge.translate.sources import Located

__all__ = ["run_demo"]


def run_demo() -> int:
    """Print the walkthrough; 0 when the DeepSpeed round trip is exact."""
    spec = resolve("zero3-offload").value
    print("== zero3-offload: what is sharded where (7e9 parameters, 64 ranks)")
    print(explain(spec, params=7_000_000_000, world_size=64).render())
    fsdp2 = write(spec, "fsdp2")
    print("\n== as FSDP2 fully_shard kwargs")
    print(json.dumps(fsdp2.value, indent=2))
    print(fsdp2.report.render())
    print("\n== DeepSpeed JSON -> spec -> DeepSpeed JSON -> spec")

    # The writer leaves the run-level keys (batch sizes, accumulation, clipping) "auto" on purpose
    # (docs/translators.md), so the round trip starts from the JSON's own spec: that one must survive.
    once = read_deepspeed(Located(write(spec, "deepspeed").value, "<demo>")).value
    twice = read_deepspeed(Located(write(once, "deepspeed").value, "<demo>")).value
    result = diff_specs(once, twice)
    print(result.render("zero3-offload as DeepSpeed JSON", "that JSON written and read once more"))
    left_auto = [d.path for d in diff_specs(spec, once).differences if d.path.split(".")[0] != "batch"]
    if left_auto:  # anything but the run-level batch keys must come through the JSON unchanged
        print(f"changed on the way through DeepSpeed JSON: {', '.join(left_auto)}")
    return 0 if result.same_run and not left_auto else 1
