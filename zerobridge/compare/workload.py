"""What ``zerobridge compare`` trains: a model, its data, its loss and its optimizer.

    >>> from zerobridge.compare.workload import resolve_model
    >>> factory = resolve_model("tiny-gpt")
    >>> work = factory(0)
    >>> work.model.num_params(), work.global_batch
    (118400, 8)
    >>> [tuple(t.shape) for t in work.batch(0)]
    [(8, 16), (8, 16)]
    >>> resolve_model("tiny-gpt:20m")(0).model.num_params()
    20091904

``--model pkg.module:factory`` names any callable ``factory(seed) ->
Workload`` importable on every rank. Every run calls it with the same seed,
so every backend starts from the same weights and sees the same batches. A
step's global batch is split along dim 0 over the ranks, and the loss of a
rank's share is ``workload.loss(model, share)`` (default: ``model(*share)``),
a mean over the share, so the mean over ranks is the global batch's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

from zerobridge.errors import ConfigError
from zerobridge.models import REFERENCE, SyntheticTokens, no_weight_decay, preset_named, tiny_gpt
from zerobridge.references import resolve_callable

__all__ = ["BUILTIN", "Workload", "adamw", "resolve_model", "tiny_gpt_workload"]

BUILTIN = REFERENCE


def _call(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    return model(*batch)


def adamw(model: nn.Module, *, lr: float = 3e-3, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW with no decay on biases, norms and embeddings of positions (names as ``no_weight_decay``)."""

    named = list(model.named_parameters())
    decay = [p for n, p in named if p.requires_grad and not no_weight_decay(n)]
    plain = [p for n, p in named if p.requires_grad and no_weight_decay(n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


@dataclass(frozen=True)
class Workload:
    """One training job, the same on every rank of every run."""

    model: nn.Module
    """The model on the CPU, before ``zerobridge.prepare``; the same weights for the same seed."""
    batch: Callable[[int], tuple[Tensor, ...]]
    """``batch(step)``: the global batch of a step; every tensor has ``global_batch`` rows."""
    global_batch: int
    """Rows per step; the world size must divide it."""
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor] = _call
    """The mean loss of one rank's rows (default ``model(*rows)``)."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = field(default=adamw)
    """Builds the optimizer on the unprepared model (default: ``adamw``)."""


def tiny_gpt_workload(seed: int, *, preset: str = "tiny", global_batch: int = 8,
                      seq_len: int = 16) -> Workload:
    """The built-in GPT on ``SyntheticTokens`` (``zerobridge.models``)."""

    model = tiny_gpt(preset, seed=seed)
    data = SyntheticTokens(model.config.vocab_size, seq_len, seed=seed)
    return Workload(model=model, batch=lambda step: data.batch(step, global_batch), global_batch=global_batch)


def resolve_model(ref: str, *, global_batch: int | None = None,
                  seq_len: int | None = None) -> Callable[[int], Workload]:
    """The factory ``--model`` names: ``tiny-gpt``, ``tiny-gpt:PRESET`` or ``pkg.module:factory``.

    ``global_batch`` and ``seq_len`` shape the built-in model's batches; a
    factory of the user's decides its own. Raises ``ConfigError`` naming
    the fix when the reference does not resolve.
    """
    preset = preset_named(ref, key="--model")
    if preset is not None:
        return partial(tiny_gpt_workload, preset=preset, global_batch=global_batch or 8, seq_len=seq_len or 16)
    head, sep, tail = ref.partition(":")
    if not sep or not head or not tail:
        raise ConfigError(f"--model {ref!r} is neither the built-in model nor pkg.module:factory", key="--model",
                          fix=f"use {BUILTIN}, {BUILTIN}:20m, or an importable module and a function, "
                              "e.g. mypkg.models:make_workload")
    if global_batch is not None or seq_len is not None:
        raise ConfigError("--global-batch and --seq-len shape the built-in model only", key="--model",
                          fix="drop them: the factory's Workload decides its own batches")
    obj = resolve_callable(ref, key="--model", wants="a function that takes a seed and returns a "
                                                     "zerobridge.compare.Workload")
    return _checked(obj, ref)


def _checked(factory: Callable[..., object], ref: str) -> Callable[[int], Workload]:
    def build(seed: int) -> Workload:
        made = factory(seed)
        if not isinstance(made, Workload):
            raise ConfigError(f"{ref}({seed}) returned {type(made).__name__}, not a Workload", key="--model",
                              fix="return zerobridge.compare.Workload(model=..., batch=..., global_batch=...)")
        return made
    return build
