"""One compare run, on every rank of a fresh process group.

``train`` is what ``zerobridge compare`` asks each rank of a
``Cluster`` to do (``Cluster.run("zerobridge.compare.worker:train", ...)``):
build the workload, ``zerobridge.prepare`` it with the backend under test,
and train with the loop every user writes (``loss.backward()``,
``zerobridge.clip_grad_norm_``, ``optimizer.step()``,
``optimizer.zero_grad()``), measuring each step. A rank returns a
``RankRecord``; the parent merges them (``zerobridge.compare.runner``).

A step is one optimizer step. Under gradient accumulation (the spec's
``batch.accumulation_for(world)`` micro-batches per step) a rank splits its
share of the step's global batch into that many equal micro-batches along
dim 0 and runs forward and backward on each; clipping, the step and
``zero_grad`` come once, at the accumulation boundary, as the engines expect
(each averages gradients over ranks and micro-batches, DeepSpeed's rule). So
a step trains on the same rows whatever the accumulation, and a correct run
with accumulation agrees with one without. The loss of a step is the mean of
its micro-batches' losses over every rank.

Timing: the ranks meet at a barrier, then the clock runs over every
micro-batch's forward and backward, clipping, the optimizer step and
``zero_grad`` (not over reading the statistics); a step's time is the
slowest rank's. Model-state bytes are read from ``zerobridge.stats`` after
the last backward and again after the step, the larger of each kept; the
collectives are counted from a ``reset_stats`` at the top of each step to
the end of ``optimizer.step()``. Peak memory is the process's high-water
resident set (``VmHWM``) over its life, and over the training steps alone
(the mark is reset after ``prepare``).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerobridge import api
from zerobridge.compare.memory import live_by_role
from zerobridge.compare.workload import resolve_model
from zerobridge.distributed import run_device
from zerobridge.models import shard

__all__ = ["RankRecord", "micro_batches", "peak_rss_bytes", "reset_peak_rss", "rss_bytes", "train"]


@dataclass
class RankRecord:
    """What one rank measured in one run."""

    losses: list[float] = field(default_factory=list)
    """Per step: the mean loss over the global batch, every micro-batch of it (the same on every rank)."""
    grad_norms: list[float] = field(default_factory=list)
    """Per step: the global gradient norm before clipping."""
    step_times: list[float] = field(default_factory=list)
    """Per step: seconds, the slowest rank's."""
    comm_bytes: list[dict[str, int]] = field(default_factory=list)
    """Per step: this rank's bytes per collective kind (bus volume, as ``zerobridge.stats``)."""
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    """``params``, ``grads``, ``optimizer``: the most this rank held of each, read after
    backward and after the step (a backend may free gradients in its step)."""
    tier_bytes: dict[str, int] = field(default_factory=dict)
    """Model state by where it lives: ``device``, ``host``, ``nvme``."""
    peak_rss_bytes: int = 0
    """This process's high-water resident set over its life (building the whole model included)."""
    steps_peak_rss_bytes: int | None = None
    """The high-water resident set during the training steps only (None where it cannot be reset)."""
    baseline_rss_bytes: int = 0
    """This process's resident set before the model was built (imports, the process group)."""
    approximations: list[dict[str, str]] = field(default_factory=list)
    """What the backend ran approximately (``allow_approximate``)."""
    live_bytes: dict[str, int] = field(default_factory=dict)
    """The same moment of the last step measured independently of the engine: live tensor storages
    by role (``zerobridge.compare.memory``: ``params``, ``grads``, ``optimizer``, ``other``)."""


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set now (Linux; 0 elsewhere)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def peak_rss_bytes() -> int:
    """This process's high-water resident set."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Restart this process's high-water mark (Linux: 5 into ``clear_refs``); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


@contextmanager
def _output_to(path: str | None) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors, so C++ and child output too) to ``path``."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for handle in (fd, *saved):
            os.close(handle)


def train(*, log: str | None = None, **kwargs: Any) -> RankRecord:
    """Train one run on this rank (``_train``'s arguments); with ``log``, everything the rank
    prints (DeepSpeed's build lines, warnings) goes to ``{log}.rank{r}.log``."""
    with _output_to(None if log is None else f"{log}.rank{dist.get_rank()}.log"):
        try:
            return _train(**kwargs)
        except BaseException:
            traceback.print_exc()  # into the log, beside what led to it
            raise


def micro_batches(rows: tuple[torch.Tensor, ...], accumulation: int) -> list[tuple[torch.Tensor, ...]]:
    """A rank's rows of one step cut into ``accumulation`` equal micro-batches along dim 0, in order.

        >>> [tuple(t.tolist() for t in m) for m in micro_batches((torch.arange(4),), 2)]
        [([0, 1],), ([2, 3],)]
    """
    return [tuple(shard(t, index, accumulation) for t in rows) for index in range(accumulation)]


def _train(*, model: str, global_batch: int | None, seq_len: int | None, choice: dict[str, Any], backend: str,
           steps: int, seed: int, clip: float | None, allow_approximate: bool, accumulation: int = 1) -> RankRecord:
    """Train ``steps`` optimizer steps of ``model`` (a ``--model`` reference) on ``backend``, each
    over ``accumulation`` micro-batches; ``choice`` is ``{"stage": N}`` or ``{"config": spec}``,
    passed on to ``zerobridge.prepare``."""

    rank, world = dist.get_rank(), dist.get_world_size()
    record = RankRecord(baseline_rss_bytes=rss_bytes())
    torch.manual_seed(seed)
    work = resolve_model(model, global_batch=global_batch, seq_len=seq_len)(seed)
    device = run_device()
    net = work.model.to(device)
    optimizer = work.optimizer(net)
    net, optimizer = api.prepare(net, optimizer, **choice, backend=backend,
                                        allow_approximate=allow_approximate)
    lifetime = peak_rss_bytes()
    reset = reset_peak_rss()
    max_norm = clip if clip else math.inf  # an infinite bound measures the norm and scales by exactly 1
    held: dict[str, int] = {}
    for step in range(steps):
        rows = tuple(shard(t, rank, world).to(device) for t in work.batch(step))
        api.reset_stats(net)
        dist.barrier()
        start = time.perf_counter()
        total = torch.zeros(1, dtype=torch.float32)
        for micro in micro_batches(rows, accumulation):  # the last backward closes the accumulation window
            loss = work.loss(net, micro)
            loss.backward()
            total += loss.detach().float().reshape(1).cpu()
        spent = time.perf_counter() - start
        # Every engine measured at one point: backward done, before clipping and the step ask
        # for the gradients (the native engine's deferred fp32 copy and DeepSpeed's fp32
        # gradient partitions both exist only from then to the end of the step).
        before = api.stats(net)
        if step == steps - 1 and step > 0:  # optimizer state exists from the step before
            record.live_bytes = live_by_role(net, optimizer)
        start = time.perf_counter()
        norm = api.clip_grad_norm_(net, max_norm)
        optimizer.step()
        spent += time.perf_counter() - start
        stats = api.stats(net)
        start = time.perf_counter()
        optimizer.zero_grad()
        spent += time.perf_counter() - start
        for key, name in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer")):
            held[name] = max(held.get(name, 0), int(before[key]), int(stats[key]))
        elapsed = torch.tensor([spent], dtype=torch.float64)
        if device.type == "cuda":
            elapsed, total = elapsed.to(device), total.to(device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        record.losses.append(total.item() / (world * accumulation))
        record.grad_norms.append(float(norm))
        record.step_times.append(elapsed.item())
        record.comm_bytes.append({k: int(v) for k, v in stats["comm_bytes"].items()})
    record.model_state_bytes = held
    record.tier_bytes = {k: int(v) for k, v in stats.get("tier_bytes", {}).items()}
    record.approximations = list(stats.get("approximations", []))
    record.peak_rss_bytes = max(lifetime, peak_rss_bytes())
    record.steps_peak_rss_bytes = peak_rss_bytes() if reset else None
    return record
