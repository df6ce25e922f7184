"""Workers for quantized-collective tests and benchmarks: a training run with ranks laid out on nodes.

    from zerobridge.harness.cluster import Cluster
    with Cluster(4) as cluster:
        runs = cluster.run("zerobridge.testing.quantized:run_on_nodes", spec=spec, ranks_per_node=2, steps=5)

``ranks_per_node`` sets ``LOCAL_WORLD_SIZE`` for the run, as a launcher on
``world / ranks_per_node`` nodes would: the engine then cuts node-sized
groups (a quantized reduction runs in two hops across them).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerobridge
from zerobridge.compare.worker import train
from zerobridge.engine.engine import Engine
from zerobridge.engine.state import group_bytes
from zerobridge.spec import StrategySpec
from zerobridge.testing import parity
from zerobridge.testing.lora import LoraNet, lora_batch

__all__ = ["lora_net", "lora_run", "run_on_nodes", "train_on_nodes"]


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


WIDTH = 96
"""Width of ``lora_net``'s blocks."""


def lora_net(seed: int = 0, *, meta: bool = False) -> LoraNet:
    """The LoRA model the frozen-weight tests train: three frozen 96 x 96 blocks with rank-4 adapters
    and a frozen head, 89% of its elements frozen (``meta``: on the meta device)."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return LoraNet(blocks=3, width=WIDTH, rank=4, seed=seed)


def lora_run(*, spec: StrategySpec, steps: int = 4, seed: int = 0, meta: bool = False) -> dict[str, Any]:
    """On every rank: ``lora_net`` trained ``steps`` steps under ``spec`` (AdamW on the adapters), then
    saved, loaded into a fresh prepared copy and stepped once more by both. Returns the losses, this
    rank's ``zerobridge.stats`` bytes at rest (and the frozen groups' alone), the frozen weights as
    the model hands them out (``full_state_dict``) and the loss of the extra step for the run and for
    its reloaded copy. ``meta``: built on the meta device, materialized by ``prepare``."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = zerobridge.prepare(lora_net(seed, meta=meta), config=spec,
                                   device=torch.device("cpu") if meta else None)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trainable, lr=1e-2)

    def step(model: nn.Module, opt: torch.optim.Optimizer, at: int) -> float:
        x, y = lora_batch(at, 4 * world, WIDTH)
        loss = model(x[4 * rank:4 * (rank + 1)], y[4 * rank:4 * (rank + 1)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        return float(total.item()) / world

    model, opt = build()
    losses = [step(model, opt, i) for i in range(steps)]
    stats = zerobridge.stats(model)
    engine: Engine = getattr(model, "zerobridge_engine")  # noqa: B009 (an attribute prepare adds)
    frozen_bytes = sum(nbytes for group in engine.groups if not group.plan.trainable
                       for (role, _), nbytes in group_bytes(group).items() if role == "params")
    frozen = {name: value.clone() for name, value in zerobridge.full_state_dict(model).items()
              if name.startswith("head.") or ".base." in name}
    root = [tempfile.mkdtemp() if rank == 0 else ""]
    dist.broadcast_object_list(root)
    path = os.path.join(root[0], "ckpt")
    zerobridge.save_checkpoint(path, model, opt)
    again, again_opt = build()
    zerobridge.load_checkpoint(path, again, again_opt)
    reloaded = {name: value for name, value in zerobridge.full_state_dict(again).items() if name in frozen}
    return {"losses": losses, "param_bytes": int(stats["param_bytes"]), "tier_bytes": dict(stats["tier_bytes"]),
            "frozen_bytes": frozen_bytes,
            "frozen": frozen, "reloaded": reloaded, "next": step(model, opt, steps),
            "next_reloaded": step(again, again_opt, steps)}
