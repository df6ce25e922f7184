"""Count what the engine communicates and holds, from outside the engine.

    >>> from zerobridge.testing.measure import formula_bytes
    >>> formula_bytes(stage=3, params=1000, shards=4, mixed=False)
    4000.0

Run ``collective_counts`` and ``memory_and_comm`` on every rank of a cluster
(``Cluster.run``). Collectives are counted by wrapping the functions of
``zerobridge.engine.collectives`` (the engine calls them through the module);
memory is measured twice: by ``zerobridge.stats`` and by scanning every live
tensor storage the process holds (``gc``), which does not trust the engine's
own accounting.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerobridge
from zerobridge.compare.workload import tiny_gpt_workload
from zerobridge.distributed import run_device
from zerobridge.engine import collectives
from zerobridge.spec import DynamicLossScale, EveryModuleWrap, PrecisionSpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing import parity

__all__ = ["collective_counts", "counting_collectives", "formula_bytes", "live_tensor_bytes", "memory_and_comm"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@contextmanager
def counting_collectives() -> Iterator[Counter[str]]:
    """Count calls of the engine's collectives that communicate (group of 2+ ranks)."""
    counts: Counter[str] = Counter()
    saved = {kind: getattr(collectives, kind) for kind in _KINDS}

    def wrap(kind: str) -> Any:
        original = saved[kind]

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = args[2] if kind in ("all_gather", "reduce_scatter") else args[1]
            if group is not None:
                counts[kind] += 1
            return original(*args, **kwargs)
        return counted

    for kind in _KINDS:
        setattr(collectives, kind, wrap(kind))
    try:
        yield counts
    finally:
        for kind, original in saved.items():
            setattr(collectives, kind, original)


def collective_counts(*, stage: int | None = None, spec: Any = None, steps: int = 2) -> dict[str, int]:
    """Collectives of the last of ``steps`` training steps of ``ParityNet``."""

    last: dict[str, int] = {}

    def mark(step: int) -> None:
        if step == steps:
            last.update(counts)
        counts.clear()

    with counting_collectives() as counts:
        parity.run_native(stage=stage, spec=spec, steps=steps, optimizer="adamw", on_step=mark,
                          collect_state=False)
    return last


def formula_bytes(*, stage: int, params: int, shards: int, mixed: bool, layout: str = "stored",
                  grad_bytes: int | None = None) -> float:
    """ZeRO paper model-state bytes per rank with Adam: fp32, or 16-bit compute with an fp32 master
    (``layout``: ``stored``, 16-bit parameters beside it, DeepSpeed; ``gathered``, fp32 parameters
    that are the master, FSDP, where parameters are sharded). Gradients take ``grad_bytes`` per
    element (default: the compute dtype's)."""
    gathered = mixed and layout == "gathered" and stage == 3
    compute = 2 if mixed else 4
    param, grad = (4 if gathered else compute), (grad_bytes or compute)
    optimizer = 12 if mixed and not gathered else 8
    p, n = float(params), float(shards)
    return sum(per * p / (n if stage >= since else 1)
               for per, since in ((param, 3), (grad, 2), (optimizer, 1)))


def _storages() -> dict[int, int]:
    """Every distinct tensor storage alive in this process: its address and bytes."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:
            continue
    seen.pop(0, None)
    return seen


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process."""
    return sum(_storages().values())


class Wide(nn.Module):
    """Plain layers of uneven sizes (about 60k parameters) for memory checks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(61, 211), nn.GELU(), nn.Linear(211, 157), nn.GELU(),
                                    nn.Linear(157, 97), nn.LayerNorm(97), nn.Linear(97, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def memory_and_comm(*, stage: int, dtype: str = "fp32", steps: int = 2, layout: str = "stored",
                    at: str = "rest") -> dict[str, Any]:
    """Train ``Wide`` with AdamW; report bytes by the engine's count and by a scan of live
    tensors, and the last step's traffic. ``at``: ``rest`` after the last step, ``backward``
    after its backward (before the optimizer step). 16-bit ``dtype``s keep an fp32 master in
    ``layout`` (``precision.compute_copy``) and reduce and accumulate in the compute dtype;
    fp16 scales the loss."""

    spec = spec_for_stage(stage)
    if stage == 3:
        spec = spec.model_copy(update={"wrapping": EveryModuleWrap()})
    if dtype != "fp32":
        scaling = DynamicLossScale(initial_scale=2.0**8) if dtype == "fp16" else None
        # FSDP's layout as FSDP2 users run it: fp32 gradients (reduced in fp32 too).
        grads = {"reduce_dtype": "fp32", "accumulate_dtype": "fp32"} if layout == "gathered" else {}
        precision = PrecisionSpec.model_validate({"param_dtype": dtype, "master_dtype": "fp32", "compute_copy": layout,
                                                  **grads, **({"loss_scaling": scaling} if scaling else {})})
        spec = spec.model_copy(update={"precision": precision})

    device = run_device()
    before = _storages()
    baseline = sum(before.values())
    model = Wide().to(device)
    params = sum(p.numel() for p in model.parameters())
    model = zerobridge.prepare(model, config=spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    after: dict[int, int] = {}
    stats = None
    for step in range(steps):
        zerobridge.reset_stats(model)
        x = torch.randn(8, 61, generator=torch.Generator().manual_seed(step + 100 * dist.get_rank())).to(device)
        model(x).float().pow(2).mean().backward()
        del x
        if at == "backward" and step == steps - 1:
            after, stats = _storages(), zerobridge.stats(model)
        optimizer.step()
    if at == "rest":
        after, stats = _storages(), zerobridge.stats(model)
    # for a failing check's message: the largest storages alive then that the run made
    made = sorted((n for p, n in after.items() if p not in before), reverse=True)[:12]
    optimizer.zero_grad()
    return {"params": params, "shards": dist.get_world_size() if stage else 1,
            "live_bytes": sum(after.values()) - baseline, "stats": stats,
            "skipped": zerobridge.stats(model).get("skipped_steps"), "largest_storages": made}


def gpt_model_state(*, preset: str, spec: Any, backend: str = "native", steps: int = 2,
                    global_batch: int = 4, seq_len: int = 128) -> dict[str, Any]:
    """Train the tiny GPT ``preset`` under ``spec`` on ``backend`` with AdamW and clipping at 1.0;
    on the last step, the bytes of every live tensor storage beyond what was live before the model
    was built: after backward (``after_backward``) and once clipping asked for the gradients, as
    the optimizer steps (``at_step``)."""

    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = live_tensor_bytes()
    work = tiny_gpt_workload(0, preset=preset, global_batch=global_batch, seq_len=seq_len)
    params = sum(p.numel() for p in work.model.parameters())
    model = zerobridge.prepare(work.model, config=spec, backend=backend)
    batch, loss = work.batch, work.loss
    del work  # the engines keep what they need of the model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out: dict[str, Any] = {"params": params}
    for step in range(steps):
        rows = tuple(t.chunk(world)[rank] for t in batch(step))
        loss(model, rows).backward()
        del rows
        if step == steps - 1:
            out["after_backward"] = live_tensor_bytes() - baseline
        zerobridge.clip_grad_norm_(model, 1.0)
        if step == steps - 1:
            out["at_step"] = live_tensor_bytes() - baseline
        optimizer.step()
        optimizer.zero_grad()
    return out
