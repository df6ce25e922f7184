"""Small targets for checking a :class:`~zerobridge.harness.cluster.Cluster`.

Each is a module-level function that a worker can import by name, e.g.
``cluster.run("zerobridge.harness.probes:all_reduce_sum", value=1.0)``. They
run after the default process group is initialised and return picklable values.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "exit_on", "fail_on", "rank_info", "sleep_s", "start_info"]


def rank_info() -> dict[str, object]:
    """This worker's rank, world size, process id and backend name."""
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "pid": os.getpid(),
        "backend": str(dist.get_backend()),
    }


def all_reduce_sum(value: float) -> float:
    """Sum ``value`` over all ranks with ``all_reduce``; every rank returns the total.

    The tensor lives on the current CUDA device under nccl, on the CPU otherwise.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor.item())


def fail_on(rank: int, message: str) -> int:
    """Raise ``ValueError(message)`` on ``rank``; every other rank returns its rank."""
    if dist.get_rank() == rank:
        raise ValueError(message)
    return dist.get_rank()


def exit_on(rank: int, code: int = 3) -> int:
    """Kill the worker process of ``rank`` at once with ``os._exit(code)`` (no
    cleanup, no answer); every other rank returns its rank."""
    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()


def sleep_s(seconds: float) -> int:
    """Sleep ``seconds`` and return this rank (to exercise timeouts)."""
    time.sleep(seconds)
    return dist.get_rank()


def start_info() -> dict[str, object]:
    """How this worker started: its parent's process id and command line (Linux: ``/proc``)."""
    parent = os.getppid()
    cmdline = Path(f"/proc/{parent}/cmdline")
    return {"parent": parent, "parent_args": cmdline.read_text().split("\0") if cmdline.exists() else []}


if __name__ == "__main__":  # a program for the zygote's tests: prints, sleeps or exits as its variables say
    print(f"probes as a program in {os.getcwd()} says {os.environ.get('PROBE_SAYS', '')}", flush=True)
    print("and to stderr", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("PROBE_SLEEP_S", "0")))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
