"""``zerobridge compare --model`` factories the tests use (and examples of writing one).

    >>> from zerobridge.testing.workloads import parity_workload
    >>> work = parity_workload(0)
    >>> work.global_batch, work.loss(work.model, work.batch(0)).item() > 0
    (8, True)

``parity_workload`` is ``ParityNet`` on its parity batches: what breaks
sharding engines (uneven sizes, a tied weight, a frozen and an unused
parameter) through a user-supplied factory. ``faulty_workload`` is the same,
except that its loss raises on rank 1 under the FSDP2 backend: a run that
fails half way. ``dropped_reduction`` is the built-in tiny GPT, except that
on rank 1 of a native-engine run every gradient bucket from step
``BROKEN_STEP`` on is reduced as zeros: the collectives still match (nothing
hangs) but one rank's share of the batch stops counting, a bug
``zerobridge compare`` must catch at that step, in bf16 too.
``undivided_accumulation`` is the built-in tiny GPT, except that the native
engine divides gradients by the world size alone, not by the accumulation
steps too: under accumulation it sums the micro-batches' gradients where
every engine averages them, a bug a config that accumulates must show.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobridge.backends.base import backend_of
from zerobridge.compare.workload import Workload, tiny_gpt_workload
from zerobridge.engine.flat_group import FlatGroup
from zerobridge.engine.plan import EnginePlan
from zerobridge.testing.parity import ParityNet, batch

__all__ = ["BROKEN_STEP", "dropped_reduction", "dropped_reduction_20m", "faulty_workload", "parity_workload",
           "undivided_accumulation"]

_ROWS = 8


def parity_workload(seed: int) -> Workload:
    """ParityNet, 8 rows of the parity batches per step."""
    return Workload(model=ParityNet(seed), batch=lambda step: batch(step, 0, _ROWS), global_batch=_ROWS)


def _faulty_loss(model: nn.Module, rows: tuple[Tensor, ...]) -> Tensor:
    if backend_of(model).name == "fsdp" and dist.get_rank() == 1:
        raise RuntimeError("faulty_workload: rank 1 fails under fsdp")
    loss: Tensor = model(*rows)
    return loss


def faulty_workload(seed: int) -> Workload:
    """``parity_workload`` whose loss raises on rank 1 under the FSDP2 backend."""
    work = parity_workload(seed)
    return Workload(model=work.model, batch=work.batch, global_batch=work.global_batch, loss=_faulty_loss,
                    optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


BROKEN_STEP = 3


def dropped_reduction(seed: int) -> Workload:
    """The tiny GPT whose native-engine rank 1 drops its gradients from ``BROKEN_STEP`` on."""
    return _dropping(tiny_gpt_workload(seed))


def dropped_reduction_20m(seed: int) -> Workload:
    """``dropped_reduction`` on the 20M preset (4 rows of 128 tokens per step)."""
    return _dropping(tiny_gpt_workload(seed, preset="20m", global_batch=4, seq_len=128))


def _dropping(work: Workload) -> Workload:
    step = [0]
    if dist.is_initialized() and dist.get_rank() == 1:
        original = FlatGroup.take_grad

        def take_grad(self: FlatGroup, b: int) -> torch.Tensor | None:
            grad = original(self, b)
            return torch.zeros_like(grad) if grad is not None and step[0] >= BROKEN_STEP else grad

        FlatGroup.take_grad = take_grad  # type: ignore[method-assign]

    def batch(at: int) -> tuple[torch.Tensor, ...]:
        step[0] = at
        return work.batch(at)
    return Workload(model=work.model, batch=batch, global_batch=work.global_batch, loss=work.loss,
                    optimizer=work.optimizer)


def undivided_accumulation(seed: int) -> Workload:
    """The tiny GPT whose native engine sums gradients over micro-batches instead of averaging them
    (in the ranks only: ``compare`` also builds the workload in its own process to plan)."""
    if dist.is_initialized():
        EnginePlan.gradient_divisor = property(lambda plan: float(plan.world_size))  # type: ignore[assignment,method-assign]
    return tiny_gpt_workload(seed)
