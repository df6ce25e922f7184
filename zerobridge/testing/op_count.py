"""Host overhead, counted: the aten ops one training step dispatches on this rank.

    >>> import torch
    >>> from zerobridge.testing.op_count import OpCounter
    >>> with OpCounter() as ops:
    ...     _ = torch.ones(3).add_(1).sum()
    >>> ops.total, ops.by_op["aten.add_"]
    (3, 1)

On a GPU each dispatched op is (at least) a kernel launch, so for small models
the count decides the step time more than the bytes do; on any machine it is
exact and repeatable, unlike a timing. ``step_ops`` counts one step of the tiny
GPT under a backend (after a first step, so one-time set-up is not counted),
on every rank of the current group: what ``tests/test_host_overhead.py``
compares between the native engine and FSDP2, and ``bench/host_overhead.py``
prints for every engine. ``fake_step_ops`` counts what ``zerobridge plan``
pays: one training step of the native engine on fake tensors in a fake process
group, for a model built to a given depth (the difference between two depths
is the cost per block).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import zerobridge
from zerobridge.backends.native.prepare import prepare
from zerobridge.models.tiny_gpt import tiny_gpt
from zerobridge.planning.fake_run import Run, fake_tracking, fake_world
from zerobridge.planning.models import resolve_model
from zerobridge.runtime.deferred_init import ShapeReplay
from zerobridge.spec.presets import spec_for_stage

__all__ = ["OpCounter", "fake_step_ops", "step_ops"]


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, by op name (``aten.add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    model(tokens, targets=tokens).backward()
    zerobridge.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()


def step_ops(backend: str, stage: int, *, preset: str = "tiny", seq_len: int = 32) -> dict[str, Any]:
    """The ops of the second training step (forward, backward, ``clip_grad_norm_``, AdamW, ``zero_grad``) of
    the ``preset`` GPT under ``backend`` at ZeRO ``stage``: ``{"total", "by_op", "collectives"}``."""
    torch.set_num_threads(1)
    model = tiny_gpt(preset, seed=0)
    seq_len = min(seq_len, model.config.block_size)
    model, optimizer = zerobridge.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                                          backend=backend, allow_approximate=True)
    tokens = torch.randint(0, model.config.vocab_size, (2, seq_len),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    _step(model, optimizer, tokens)
    with OpCounter() as ops:
        _step(model, optimizer, tokens)
    collectives = {k: v for k, v in ops.by_op.items() if k.startswith("c10d.")}
    return {"total": ops.total, "by_op": dict(ops.by_op), "collectives": collectives}


def fake_step_ops(model: str, stage: int, layers: int, *, world_size: int = 8, seq_len: int = 256) -> dict[str, int]:
    """The ops of the second step of a plan's fake run (``zerobridge plan``'s own measurement: native engine,
    fake tensors, fake process group of ``world_size``, the plan's storage tracker on) of ``model`` (what
    ``zerobridge plan`` takes) built ``layers`` deep, at ZeRO ``stage``; by op name. ``prim.device`` counts
    the device queries fake tensors answer in Python (autograd asks one per gradient): metadata, no kernel."""
    source = resolve_model(model)
    built = source.build(layers)
    spec = spec_for_stage(stage, built)
    run = Run(world_size=world_size, nodes=1, micro_batch=1, seq_len=seq_len)
    counted: list[dict[str, int]] = []
    with fake_world(run.world_size, run.ranks_per_node), fake_tracking():
        prepare(built, None, spec, allow_approximate=False, replay=ShapeReplay(built), device=torch.device("cpu"))
        optimizer = torch.optim.AdamW([p for p in built.parameters() if p.requires_grad], lr=1e-3, foreach=False)
        tokens = torch.randint(0, max(source.vocab_size, 2), (run.micro_batch, seq_len))
        for _ in range(2):
            with OpCounter() as ops:
                source.loss(built, tokens).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            counted.append(dict(ops.by_op))
    return counted[-1]
