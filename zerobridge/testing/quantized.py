"""Workers for quantized-collective tests and benchmarks: a training run with ranks laid out on nodes.

    from zerobridge.harness.cluster import Cluster
    with Cluster(4) as cluster:
        runs = cluster.run("zerobridge.testing.quantized:run_on_nodes", spec=spec, ranks_per_node=2, steps=5)

``ranks_per_node`` sets ``LOCAL_WORLD_SIZE`` for the run, as a launcher on
``world / ranks_per_node`` nodes would: the engine then cuts node-sized
groups (a quantized reduction runs in two hops across them).
"""

from __future__ import annotations

import os
from typing import Any

from zerobridge.compare.worker import train
from zerobridge.testing import parity

__all__ = ["run_on_nodes", "train_on_nodes"]


def run_on_nodes(*, ranks_per_node: int, **kwargs: Any) -> parity.RunResult:
    """``parity.run_native(**kwargs)`` with ``ranks_per_node`` ranks to a node."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    try:
        return parity.run_native(**kwargs)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def train_on_nodes(*, ranks_per_node: int, **kwargs: Any) -> Any:
    """``zerobridge.compare.worker.train(**kwargs)`` with ``ranks_per_node`` ranks to a node."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    try:
        return train(**kwargs)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
