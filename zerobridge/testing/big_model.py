"""One rank's side of ``bench/big_model.py``: build, prepare and load a large GPT three ways.

    >>> from zerobridge.testing.big_model import floor_bytes
    >>> from zerobridge.models.tiny_gpt import PRESETS
    >>> floor_bytes(PRESETS["tiny"], world=2, baseline=0)
    436480

Each call runs in a fresh process group (``Cluster``), so the resident set it
reports is its own: the high-water mark is reset once the group is up, then
the model is built, prepared and loaded, and the rise is read; then one
training step (forward, backward, SGD) and a second forward give the losses.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist

import zerobridge
from zerobridge.compare.worker import peak_rss_bytes, reset_peak_rss, rss_bytes
from zerobridge.models.tiny_gpt import GPTConfig, TinyGPT, count_params
from zerobridge.testing.deferred import exact_rss

__all__ = ["big_model_run", "floor_bytes"]


def floor_bytes(config: GPTConfig, *, world: int, baseline: int) -> int:
    """``4P/N + 4 x largest unit + baseline``: a rank's shard of fp32 parameters, one
    fp32 unit in flight, and the process before the model (the issue's floor)."""
    e = config.n_embd
    root = config.vocab_size * e + config.block_size * e + 2 * e  # embeddings and the final norm
    block = (count_params(config) - root) // config.n_layer
    return 4 * count_params(config) // world + 4 * max(root, block) + baseline


def _load_eagerly(model: TinyGPT, source: str) -> None:
    """What a user does without zerobridge: every tensor into the full model, one at a time."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    with safe_open(source, framework="pt") as fh, torch.no_grad():
        for name in fh.keys():
            params[name].copy_(fh.get_tensor(name))


def big_model_run(*, path: str, source: str, config: dict[str, Any], steps_tokens: int = 64) -> dict[str, Any]:
    """On every rank: ``path`` is ``eager`` (build, load every tensor, prepare),
    ``meta`` (meta build, prepare, ``load_pretrained``) or ``fsdp-meta`` (the same
    on ``backend="fsdp"``). Returns RSS figures, seconds and two losses."""

    exact_rss()
    cfg = GPTConfig(**config)
    gc.collect()
    reset_peak_rss()
    baseline = rss_bytes()
    start = time.perf_counter()
    backend = "fsdp" if path == "fsdp-meta" else "native"
    if path == "eager":
        model = TinyGPT(cfg, seed=1)
        _load_eagerly(model, source)
        model = zerobridge.prepare(model, stage=3)
    else:
        model = zerobridge.prepare(TinyGPT(cfg, device="meta"), stage=3, backend=backend)
        zerobridge.load_pretrained(model, source)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.vocab_size, (world, steps_tokens + 1), generator=g)
    tokens, targets = data[rank:rank + 1, :-1], data[rank:rank + 1, 1:]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(tokens, targets)
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"path": path, "baseline": baseline, "peak": peak, "rise": peak - baseline, "seconds": seconds,
            "floor": floor_bytes(cfg, world=world, baseline=baseline), "losses": losses,
            "params": count_params(cfg)}
