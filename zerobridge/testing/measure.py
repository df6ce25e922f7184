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

from zerobridge.engine import collectives

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
    from zerobridge.testing import parity

    last: dict[str, int] = {}

    def mark(step: int) -> None:
        if step == steps:
            last.update(counts)
        counts.clear()

    with counting_collectives() as counts:
        parity.run_native(stage=stage, spec=spec, steps=steps, optimizer="adamw", on_step=mark,
                          collect_state=False)
    return last


def formula_bytes(*, stage: int, params: int, shards: int, mixed: bool) -> float:
    """ZeRO paper model-state bytes per rank with Adam: fp32 or 16-bit compute with fp32 master."""
    p, n = float(params), float(shards)
    if not mixed:
        return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]
    return {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # noqa: BLE001 - some tensor subclasses have no storage
            continue
    seen.pop(0, None)
    return sum(seen.values())


class Wide(nn.Module):
    """Plain layers of uneven sizes (about 60k parameters) for memory checks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(61, 211), nn.GELU(), nn.Linear(211, 157), nn.GELU(),
                                    nn.Linear(157, 97), nn.LayerNorm(97), nn.Linear(97, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def memory_and_comm(*, stage: int, dtype: str = "fp32", steps: int = 2) -> dict[str, Any]:
    """Train ``Wide`` with AdamW; report, at rest after the last step, bytes by the
    engine's count and by a scan of live tensors, and the last step's traffic."""
    import zerobridge
    from zerobridge.api import spec_for_stage
    from zerobridge.spec import EveryModuleWrap, PrecisionSpec

    spec = spec_for_stage(stage)
    if stage == 3:
        spec = spec.model_copy(update={"wrapping": EveryModuleWrap()})
    if dtype != "fp32":
        spec = spec.model_copy(update={"precision": PrecisionSpec(param_dtype=dtype, master_dtype="fp32")})
    from zerobridge.testing.parity import run_device

    device = run_device()
    baseline = live_tensor_bytes()
    model = Wide().to(device)
    params = sum(p.numel() for p in model.parameters())
    model = zerobridge.prepare(model, config=spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        zerobridge.reset_stats(model)
        x = torch.randn(8, 61, generator=torch.Generator().manual_seed(step + 100 * dist.get_rank())).to(device)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        del x
    live = live_tensor_bytes() - baseline
    stats = zerobridge.stats(model)
    optimizer.zero_grad()
    return {"params": params, "shards": dist.get_world_size() if stage else 1, "live_bytes": live, "stats": stats}
