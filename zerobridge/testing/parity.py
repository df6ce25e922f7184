"""Train one small model under a strategy and under a single-process reference.

    >>> from zerobridge.testing.parity import run_reference
    >>> ref = run_reference(steps=3)
    >>> len(ref.losses), ref.losses[0] > ref.losses[-1]
    (3, True)

``run_native`` runs on every rank of a process group (``Cluster.run``) and
``run_reference`` in one process without any group: same seed, same
initial weights, the same global batch per step (split across ranks and
micro-batches in the sharded run). ``ParityNet`` packs what breaks sharding
engines into a few hundred parameters: sizes not divisible by the world
size, a weight tied between the embedding and the head, a frozen layer, a
parameter no forward uses, LayerNorm, and names that put biases and norms
into a param group without weight decay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerobridge
from zerobridge.distributed import run_device
from zerobridge.spec.presets import spec_for_stage

__all__ = ["ParityNet", "RunResult", "batch", "run_native", "run_reference"]

VOCAB, WIDTH, HIDDEN, SEQ = 37, 13, 29, 5


class Layer(nn.Module):
    """A residual MLP layer with LayerNorm; the transformer-wrap unit of ``ParityNet``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ParityNet(nn.Module):
    """Tied embedding/head, two layers, a frozen projection, an unused parameter."""

    _no_split_modules = ["Layer"]

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 2)
        self.norm_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = x + 0.5 * self.frozen(x)
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, micro: int, size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch ``micro`` of ``step``: (tokens, targets)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + micro)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Biases and norms without weight decay, the rest with (by name: shapes are sharded)."""
    plain = [p for n, p in named if n.endswith("bias") or "norm" in n]
    decayed = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def make_optimizer(named: list[tuple[str, nn.Parameter]], kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(param_groups(named, 0.1), lr=3e-2)
    if kind == "sgd":
        return torch.optim.SGD(param_groups(named, 0.01), lr=0.3, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}")


@dataclass
class RunResult:
    """What a run reports, on one rank."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""
    eval_loss: float = 0.0
    """Loss on a held-out batch under ``torch.no_grad()`` after training."""
    names: list[str] = field(default_factory=list)
    """``named_parameters()`` and ``state_dict()`` keys of the prepared model."""
    graphs: list[int] = field(default_factory=list)
    """Compiled runs: graphs dynamo has made so far, after each training step."""
    graph_breaks: int = 0
    """Compiled runs: graph breaks dynamo met in training."""


def run_reference(*, steps: int = 10, optimizer: str = "adamw", global_batch: int = 8, accumulation: int = 1,
                  clip: float | None = 1.0, dtype: str = "fp32", seed: int = 0,
                  skip_steps: tuple[int, ...] = ()) -> RunResult:
    """One process, the whole global batch: the numbers a sharded run must match.

    ``skip_steps``: steps that compute gradients but do not step (as in a run
    whose loss scale overflowed)."""
    model = ParityNet(seed)
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    opt = make_optimizer(list(model.named_parameters()), optimizer)
    result = RunResult()
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            tokens, targets = batch(step, micro, global_batch // accumulation)
            with torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32):
                loss = model(tokens, targets) / accumulation
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        if step not in skip_steps:
            opt.step()
        opt.zero_grad()
        result.losses.append(total)
        result.grad_norms.append(norm.item())
    with torch.no_grad():
        result.eval_loss = model(*batch(10_000, 0, global_batch)).item()
    result.state = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def run_native(*, stage: int | None = None, spec: Any = None, steps: int = 10, optimizer: str = "adamw",
               global_batch: int = 8, accumulation: int = 1, accumulation_mode: str = "spec",
               clip: float | None = 1.0, seed: int = 0, prepare_optimizer: bool = False,
               on_step: Callable[[int], None] | None = None, collect_state: bool = True,  # on_step(steps): done
               from_env: bool = False, meta: bool = False, compile: str | None = None) -> RunResult:
    """On every rank: the same training under ZeRO ``stage`` or ``spec``.

    ``accumulation_mode``: ``spec`` (the spec's accumulation steps; backward on
    the undivided loss, as with DeepSpeed), ``no_sync`` (divided loss, all but
    the last micro-batch under ``model.no_sync()``, as with FSDP) or ``plain``
    (divided loss, every backward reduces, torch's accumulate-until-zero_grad).
    ``meta``: build the model on the meta device and let ``prepare`` materialize it.
    ``compile``: ``"spec"`` (``prepare(..., compile=True)``, the spec's compile
    settings), ``"before"`` or ``"after"`` (``torch.compile(model)`` before or after
    ``prepare``); dynamo's graph and graph-break counts are recorded per step.
    """

    rank, world = dist.get_rank(), dist.get_world_size()
    device = run_device()
    if meta:
        with torch.device("meta"):
            model = ParityNet(seed)
    else:
        model = ParityNet(seed).to(device)
    if from_env:
        spec = None
    elif spec is None:
        spec = spec_for_stage(stage if stage is not None else 0, model)
    if accumulation_mode == "spec" and spec is not None:
        spec = spec.model_copy(update={"batch": spec.batch.model_copy(update={"accumulation_steps": accumulation})})
    if compile is not None:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
    if compile == "before":
        model = torch.compile(model)  # type: ignore[assignment]
    options: dict[str, Any] = {"config": spec, "device": device if meta else None,  # config None: ZEROBRIDGE_CONFIG
                               "compile": True if compile == "spec" else None}
    if prepare_optimizer:
        opt = make_optimizer(list(model.named_parameters()), optimizer)
        model, opt = zerobridge.prepare(model, opt, **options)
    else:
        model = zerobridge.prepare(model, **options)
        opt = make_optimizer(list(model.named_parameters()), optimizer)
    if compile == "after":
        model = torch.compile(model)  # type: ignore[assignment]
    result = RunResult(summary=model.zerobridge_engine.plan.spec.summary(),
                       names=[n for n, _ in model.named_parameters(remove_duplicate=False)] + list(model.state_dict()))
    per_rank = global_batch // accumulation // world
    for step in range(steps):
        zerobridge.reset_stats(model)
        if on_step is not None:
            on_step(step)
        total = torch.zeros(1, device=device)
        for micro in range(accumulation):
            tokens, targets = (t.to(device) for t in batch(step, micro, global_batch // accumulation))
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            quiet = accumulation_mode == "no_sync" and micro < accumulation - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = model(tokens[mine], targets[mine])
                if accumulation_mode != "spec":
                    loss = loss / accumulation
                loss.backward()
            total += loss.detach().float() / (accumulation if accumulation_mode == "spec" else 1)
        norm = zerobridge.clip_grad_norm_(model, clip if clip is not None else float("inf"))
        opt.step()
        result.stats.append(zerobridge.stats(model))
        opt.zero_grad()
        dist.all_reduce(total)
        result.losses.append(total.item() / world)
        result.grad_norms.append(norm.item())
        if compile is not None:
            result.graphs.append(counters["stats"]["unique_graphs"])
            result.graph_breaks = sum(counters["graph_break"].values())
    if on_step is not None:
        on_step(steps)  # the end of training
    with torch.no_grad():
        tokens, targets = (t.to(device) for t in batch(10_000, 0, global_batch))
        mine = slice(rank * (global_batch // world), (rank + 1) * (global_batch // world))
        held_out = model(tokens[mine], targets[mine]).float().reshape(1)
        dist.all_reduce(held_out)
        result.eval_loss = held_out.item() / world
    if collect_state:
        result.state = {k: v.cpu() for k, v in zerobridge.full_state_dict(model).items()}
    return result


def leave_early(*, rank_that_leaves: int) -> str:
    """One rank returns at once while the others start training: they must fail
    with a timeout error, not hang."""
    if dist.get_rank() == rank_that_leaves:
        return "left"
    run_native(stage=3, steps=1)
    return "trained"
