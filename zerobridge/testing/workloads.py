"""``zerobridge compare --model`` factories the tests use (and examples of writing one).

    >>> from zerobridge.testing.workloads import parity_workload
    >>> work = parity_workload(0)
    >>> work.global_batch, work.loss(work.model, work.batch(0)).item() > 0
    (8, True)

``parity_workload`` is ``ParityNet`` on its parity batches: what breaks
sharding engines (uneven sizes, a tied weight, a frozen and an unused
parameter) through a user-supplied factory. ``faulty_workload`` is the same,
except that its loss raises on rank 1 under the FSDP2 backend: a run that
fails half way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobridge.compare.workload import Workload
from zerobridge.testing.parity import ParityNet, batch

__all__ = ["faulty_workload", "parity_workload"]

_ROWS = 8


def parity_workload(seed: int) -> Workload:
    """ParityNet, 8 rows of the parity batches per step."""
    return Workload(model=ParityNet(seed), batch=lambda step: batch(step, 0, _ROWS), global_batch=_ROWS)


def _faulty_loss(model: nn.Module, rows: tuple[Tensor, ...]) -> Tensor:
    from zerobridge.backends import backend_of

    if backend_of(model).name == "fsdp" and dist.get_rank() == 1:
        raise RuntimeError("faulty_workload: rank 1 fails under fsdp")
    loss: Tensor = model(*rows)
    return loss


def faulty_workload(seed: int) -> Workload:
    """``parity_workload`` whose loss raises on rank 1 under the FSDP2 backend."""
    work = parity_workload(seed)
    return Workload(model=work.model, batch=work.batch, global_batch=work.global_batch, loss=_faulty_loss,
                    optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
