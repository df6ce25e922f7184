"""Mixed precision layouts on one rank: where the 16-bit copy and the gradients live.

``precision.compute_copy="stored"`` with 16-bit gradients (DeepSpeed's layout) keeps
one copy of the gradients, in the store; the optimizer's fp32 gradients are cast from it
at the step (or when ``clip_grad_norm_`` asks) and dropped after it. ``"gathered"``
(FSDP's) keeps the fp32 shard as the master and casts the 16-bit copy at each gather.
Distributed parity and the byte formulas: tests/test_engine_features.py and
tests/test_engine_comm.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerobridge
from zerobridge.spec import DynamicLossScale, PrecisionSpec, ShardingSpec, StrategySpec, TransformerWrap

pytestmark = pytest.mark.usefixtures("solo_group")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _prepare(stage: int, layout: str = "stored", dtype: str = "bf16", **precision: Any) -> nn.Module:
    spec = StrategySpec(sharding=ShardingSpec.for_stage(stage), wrapping=TransformerWrap(layer_classes=["Block"]),
                        precision=PrecisionSpec(param_dtype=dtype, master_dtype="fp32", compute_copy=layout,
                                                **precision))
    return zerobridge.prepare(Net(), config=spec)


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    x = torch.linspace(-1, 1, 32).reshape(4, 8) * scale
    model(x).float().pow(2).mean().backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 3])
def test_stored_16bit_gradients_reach_the_optimizer_only_at_the_step(stage: int) -> None:
    model = _prepare(stage)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _backward(model)
    assert all(p.grad is None for p in model.parameters()), "no fp32 copy beside the 16-bit store"
    stats = zerobridge.stats(model)
    params = sum(p.numel() for p in Net().parameters())
    assert stats["grad_bytes"] <= 2 * params + 64, stats["grad_bytes"]  # bf16 store (+ padding)
    zerobridge.clip_grad_norm_(model, 1e9)  # asks for the gradients: cast now, in the master dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    optimizer.step()
    assert all(p.grad is None for p in model.parameters()), "the fp32 copies are dropped after the step"
    assert zerobridge.stats(model)["grad_bytes"] == stats["grad_bytes"]


def test_gradients_no_step_consumed_accumulate_like_torch() -> None:
    """Two backwards at two boundaries with no step between add up (torch keeps ``p.grad``
    until zero_grad); the same batch twice is exactly twice one batch."""
    once, twice = _prepare(3), _prepare(3)
    _backward(once)
    _backward(twice)
    _backward(twice)
    zerobridge.clip_grad_norm_(once, 1e9)
    zerobridge.clip_grad_norm_(twice, 1e9)
    for a, b in zip(_grads(once), _grads(twice)):
        assert torch.equal(2 * a, b)


def test_zero_grad_after_the_cast_clears_them() -> None:
    model = _prepare(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    _backward(model)
    zerobridge.clip_grad_norm_(model, 1e9)
    first = _grads(model)
    optimizer.zero_grad()
    _backward(model)
    zerobridge.clip_grad_norm_(model, 1e9)
    for a, b in zip(first, _grads(model)):
        assert torch.equal(a, b)


def test_a_skipped_fp16_step_drops_the_overflowed_gradients() -> None:
    model = _prepare(2, dtype="fp16", loss_scaling=DynamicLossScale(initial_scale=1.0, hysteresis=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(model, scale=1e5)  # fp16 overflows: the step is skipped
    optimizer.step()
    assert zerobridge.stats(model)["skipped_steps"] == 1
    _backward(model)
    optimizer.step()
    assert zerobridge.stats(model)["skipped_steps"] == 1, "the next window starts from zero"
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_gathered_layout_steps_the_fp32_shard_and_trains_like_stored(stage: int) -> None:
    """FSDP's layout: the parameters the optimizer sees hold fp32 values at rest and no 16-bit
    copy stays (stage 3); the numbers are those of DeepSpeed's layout, to the bit."""
    runs = {}
    for layout in ("stored", "gathered"):
        model = _prepare(stage, layout, reduce_dtype="fp32", accumulate_dtype="fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            x = torch.linspace(-1, 1, 32).reshape(4, 8)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        groups = model.zerobridge_engine.groups
        runs[layout] = (losses, zerobridge.full_state_dict(model), groups)
        torch.distributed.destroy_process_group()
    (stored, stored_state, _), (gathered, gathered_state, groups) = runs["stored"], runs["gathered"]
    assert stored == gathered
    assert all(torch.equal(stored_state[k], gathered_state[k]) for k in stored_state)
    sharded = [g for g in groups if g.shard is not None]
    assert bool(sharded) == (stage == 3)
    for group in sharded:
        assert group.shard.dtype == torch.float32 and group.master is None
        assert group.full.untyped_storage().nbytes() == 0, "the bf16 copy exists only while gathered"
