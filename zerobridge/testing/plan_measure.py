"""What a plan predicted, checked against a real run: the worker every rank of a gloo group runs.

    from zerobridge.harness.cluster import Cluster
    with Cluster(2) as cluster:
        peaks = cluster.run("zerobridge.testing.plan_measure:measure", model="tiny-gpt", spec=spec_json,
                            micro_batch=2, seq_len=16)

Each rank builds the model on the meta device, prepares it with the native
engine (real initial values), trains the plan's two steps on real tensors and
returns the live tensor bytes it reached per phase (``StorageTracker``, the
same count the plan makes on fake tensors) and its tiers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerobridge.planning.fake_run import Run, run_real
from zerobridge.planning.models import resolve_model
from zerobridge.spec import StrategySpec

__all__ = ["measure"]


def measure(*, model: str, spec: dict[str, Any], micro_batch: int, seq_len: int, accumulation: int = 1,
            nodes: int = 1, optimizer: str = "adamw") -> dict[str, Any]:
    """Per-phase peaks and tiers of this rank in a real two-step run of ``spec``."""
    torch.set_num_threads(1)
    run = Run(world_size=dist.get_world_size(), nodes=nodes, micro_batch=micro_batch, seq_len=seq_len,
              accumulation=accumulation, optimizer=optimizer)
    measured = run_real(resolve_model(model), StrategySpec.model_validate(spec), run)
    return {"peaks": measured.peaks, "tiers": measured.tiers, "comm_bytes": measured.comm_bytes}
