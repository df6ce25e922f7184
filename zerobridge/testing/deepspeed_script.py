"""A classic DeepSpeed training script whose only switch is its import line (``--flavor real|zerobridge``).

    python -m torch.distributed.run --nproc-per-node 2 -m zerobridge.testing.deepspeed_script \\
        --flavor zerobridge --config adamw.json --config sgd.json --steps 10 --out steps.json \\
        --save /tmp/ckpt --tag step6 --save-at 6
    python -m torch.distributed.run --nproc-per-node 2 -m zerobridge.testing.deepspeed_script \\
        --flavor zerobridge --config adamw.json --config sgd.json --steps 10 --out resumed.json --resume /tmp/ckpt

Each ``--config`` (a DeepSpeed JSON with its ``optimizer`` and ``scheduler`` sections) is one run, in the same
process group, one after the other: the launch cost (imports, the process group, DeepSpeed's ops) is paid once
for several optimizer/scheduler pairs. A run is the shape DeepSpeed's tutorials have::

    import deepspeed                          # or: import zerobridge.deepspeed as deepspeed
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path)
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

on ``Net`` (a two-layer MLP with dropout, built from a fixed seed, its own MSE loss) and per-rank data drawn from a
seed of (rank, micro-step), so every flavor, backend and stage sees the same numbers. The dropout masks come from the
global random state, seeded once by ``main`` *before* ``deepspeed.init_distributed()``, as DeepSpeed scripts do: an
entry point that drew a random number (``init_distributed``, ``initialize``) would change the masks of the first
optimizer step. Every later optimizer step reseeds it (``reseed``, from the micro-step number, as a script that
reseeds each epoch), so a run resumed at any boundary draws the masks the uninterrupted one drew, whoever saved.
``--flavor real`` runs DeepSpeed; ``--flavor zerobridge`` runs ``zerobridge.deepspeed`` on the backend
``$ZEROBRIDGE_BACKEND`` names.

Per micro-step it records the loss (each rank's, gathered), ``is_gradient_accumulation_boundary()`` before
``step()``, ``get_lr()`` before and after ``step()``, ``get_global_grad_norm()`` after a boundary's ``step()``,
and the counters ``global_steps``, ``global_samples``. With ``--save DIR``, after micro-step ``--save-at`` it calls
``engine.save_checkpoint(DIR/<config stem>, tag=--tag, client_state=CLIENT_STATE)`` and goes on. With
``--resume DIR`` it first calls ``engine.load_checkpoint(DIR/<config stem>)`` (the tag in ``latest``), records
the path and client state it returns, and continues from micro-step ``global_steps x gradient_accumulation_steps``
to ``--steps``. Rank 0 writes ``{"flavor", "backend", "world_size", "runs": {stem: {...}}}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.api import stats
from zerobridge.backends.base import backend_of

__all__ = ["CLIENT_STATE", "DROPOUT", "Net", "main", "micro_batch", "reseed", "train"]

CLIENT_STATE: dict[str, Any] = {"epoch": 3, "note": "x"}
"""What ``--save`` passes as ``client_state``."""
IN, HIDDEN, OUT = 8, 16, 4
SEED = 1234


DROPOUT = 0.25


class Net(nn.Module):
    """``Linear(8, 16) -> tanh -> Dropout -> Linear(16, 4)``; ``forward(x, y)`` is the mean squared error
    against ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.drop = nn.Dropout(DROPOUT)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)


def reseed(step: int) -> None:
    """Seed the global random state (the dropout masks) for micro-steps from ``step`` on."""
    torch.manual_seed(SEED + 7919 * (step + 1) + dist.get_rank())


def micro_batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of micro-step ``step`` (0-based): the same whatever ran before it."""
    gen = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    x = torch.randn(size, IN, generator=gen)
    return x, 2.0 * torch.randn(size, OUT, generator=gen)


def _floats(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values]


def trained_by(engine: Any) -> dict[str, Any]:
    """What ran the steps: the engine's class, the optimizer's, and under ``zerobridge.deepspeed`` the backend, the
    class of what it wraps (DeepSpeed's engine on ``ZEROBRIDGE_BACKEND=deepspeed``) and what it approximates."""
    found: dict[str, Any] = {"engine": f"{type(engine).__module__}.{type(engine).__name__}",
                             "optimizer": type(engine.optimizer).__name__}
    if type(engine).__module__.startswith("zerobridge."):
        backend = backend_of(engine.module)
        inner = getattr(backend, "engine", None)
        found |= {"backend": type(backend).__name__,
                  "wraps": None if inner is None else f"{type(inner).__module__}.{type(inner).__name__}",
                  "approximations": [str(a) for a in stats(engine.module).get("approximations", [])]}
    return found


def train(deepspeed: Any, config: Path, steps: int, *, save: Path | None = None, tag: str | None = None,
          save_at: int | None = None, resume: Path | None = None) -> dict[str, Any]:
    """One run of ``config`` through ``deepspeed`` (the real module or ``zerobridge.deepspeed``): what it records."""
    with torch.random.fork_rng():  # the same weights every run; the masks' random state goes on untouched
        torch.manual_seed(SEED)
        model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=str(config))
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = int(engine.train_micro_batch_size_per_gpu())
    accumulation = int(engine.gradient_accumulation_steps())
    record: dict[str, Any] = {"stage": int(engine.zero_optimization_stage()), "micro_steps": [], "loaded": None,
                              **trained_by(engine)}
    start = 0
    if resume is not None:
        path, client_state = engine.load_checkpoint(str(resume))
        record["loaded"] = {"path": None if path is None else str(path), "client_state": client_state,
                            "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                            "lr": _floats(engine.get_lr())}
        start = int(engine.global_steps) * accumulation
    engine.train()
    for step in range(start, steps):
        if step > 0 and step % accumulation == 0:  # a new optimizer step: its masks depend on nothing before it
            reseed(step)
        x, y = micro_batch(rank, step, micro)
        lr = _floats(engine.get_lr())
        loss = engine(x, y)
        engine.backward(loss)
        boundary = bool(engine.is_gradient_accumulation_boundary())
        engine.step()
        losses: list[float | None] = [None] * world
        dist.all_gather_object(losses, float(loss.detach()))
        norm = engine.get_global_grad_norm() if boundary else None
        record["micro_steps"].append({
            "step": step, "loss": losses, "boundary": boundary, "lr": lr, "lr_after": _floats(engine.get_lr()),
            "grad_norm": None if norm is None else float(norm), "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples), "micro_steps": int(engine.micro_steps)})
        if save is not None and step + 1 == save_at:
            engine.save_checkpoint(str(save), tag=tag, client_state=dict(CLIENT_STATE))
    return record


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--flavor", choices=("real", "zerobridge"), required=True,
                        help="real: import deepspeed; zerobridge: import zerobridge.deepspeed as deepspeed")
    parser.add_argument("--config", type=Path, action="append", required=True,
                        help="a DeepSpeed JSON (repeat: one run each, in this order)")
    parser.add_argument("--steps", type=int, required=True, help="micro-steps per run (counted from 0)")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the record here")
    parser.add_argument("--save", type=Path, help="save each run under SAVE/<config stem>")
    parser.add_argument("--tag", help="the checkpoint tag (default: DeepSpeed's global_stepN)")
    parser.add_argument("--save-at", type=int, help="save after this many micro-steps")
    parser.add_argument("--resume", type=Path, help="load each run from RESUME/<config stem> first")
    args = parser.parse_args(argv)
    if args.save is not None and args.save_at is None:
        parser.error("--save needs --save-at")
    stems = [c.stem for c in args.config]
    if len(set(stems)) != len(stems):
        parser.error(f"config file names must differ: {stems}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    deepspeed = importlib.import_module("deepspeed" if args.flavor == "real" else "zerobridge.deepspeed")
    torch.manual_seed(SEED + int(os.environ.get("RANK", "0")))  # the masks' seed, set before the group starts
    deepspeed.init_distributed()
    runs = {config.stem: train(deepspeed, config, args.steps,
                               save=None if args.save is None else args.save / config.stem, tag=args.tag,
                               save_at=args.save_at, resume=None if args.resume is None else args.resume / config.stem)
            for config in args.config}
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        backend = os.environ.get("ZEROBRIDGE_BACKEND", "native") if args.flavor == "zerobridge" else None
        record = {"flavor": args.flavor, "backend": backend,
                  "world_size": dist.get_world_size(), "runs": runs}
        args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown: DeepSpeed's CPU ops can abort in their static destructors ("terminate called
    # without an active exception", seen once in several launches) after the record is written and the group is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
