"""Train ParityNet on any backend with the same loop, on every rank of a ``Cluster``.

    from zerobridge.harness.cluster import Cluster

    if __name__ == "__main__":
        with Cluster(2) as cluster:
            runs = cluster.run("zerobridge.testing.fsdp_run:train", backend="fsdp", stage=3)
            print(runs[0].losses)          # compare with zerobridge.testing.parity.run_reference()

``train`` is ``zerobridge.testing.parity.run_native``'s loop (the spec's
accumulation steps, backward on the undivided loss, the global batch split
across ranks and micro-batches) with the backend as an argument, so its
losses are comparable with ``run_reference`` and with each other.
``step_every_micro=True`` calls ``optimizer.step()`` and ``zero_grad()``
after every micro-batch, as a DeepSpeed loop does: the backend must turn
every step outside the accumulation boundary into a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerobridge
from zerobridge.backends.base import backend_of
from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing.parity import ParityNet, RunResult, batch, make_optimizer
from zerobridge.testing.resume import train_steps

__all__ = ["BackendRun", "misuse", "refusals", "resume", "save_after", "starts_from_rank0", "train"]


@dataclass
class BackendRun(RunResult):
    """A ``RunResult`` plus what the backend holds locally."""

    local: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's part of each parameter (its DTensor shard) after training."""
    coordinate: tuple[int, ...] = ()
    """This rank's position in the backend's mesh."""
    approximations: list[dict[str, Any]] = field(default_factory=list)
    forward_calls: int = 0
    """Calls of ``layers.0.up`` (inside a layer unit): twice per step when activations are recomputed."""


def _spec(stage: int | None, spec: Any, model: torch.nn.Module, accumulation: int) -> Any:
    value = spec_for_stage(stage if stage is not None else 3, model) if spec is None else \
        StrategySpec.model_validate(spec) if isinstance(spec, dict) else spec
    return value.model_copy(update={"batch": value.batch.model_copy(update={"accumulation_steps": accumulation})})


def train(*, backend: str, stage: int | None = None, spec: Any = None, steps: int = 10, accumulation: int = 1,
          global_batch: int = 8, allow_approximate: bool = False, optimizer_first: bool = True,
          step_every_micro: bool = False, clip: float | None = 1.0, meta: bool = False) -> BackendRun:
    """On every rank: ParityNet trained ``steps`` steps on ``backend`` under ``stage`` or ``spec``.
    ``meta``: built on the meta device from seed 0, for ``prepare`` to materialize."""

    rank, world = dist.get_rank(), dist.get_world_size()
    if meta:
        with torch.device("meta"):
            model = ParityNet(0)
    else:
        model = ParityNet(0)
    config = _spec(stage, spec, model, accumulation)
    calls = [0]
    model.get_submodule("layers.0.up").register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    if optimizer_first:
        opt = make_optimizer(list(model.named_parameters()), "adamw")
        model, opt = zerobridge.prepare(model, opt, config=config, backend=backend,
                                        allow_approximate=allow_approximate)
    else:
        model = zerobridge.prepare(model, config=config, backend=backend, allow_approximate=allow_approximate)
        opt = make_optimizer(list(model.named_parameters()), "adamw")
    result = BackendRun(names=[n for n, _ in model.named_parameters(remove_duplicate=False)])
    per_rank = global_batch // accumulation // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(steps):
        zerobridge.reset_stats(model)
        total = torch.zeros(1)
        for micro in range(accumulation):
            tokens, targets = batch(step, micro, global_batch // accumulation)
            loss = model(tokens[mine], targets[mine])
            loss.backward()
            total += loss.detach().float() / accumulation
            if step_every_micro and micro < accumulation - 1:
                opt.step()  # not a boundary: must do nothing
                opt.zero_grad()  # must not drop the accumulated gradients
        norm = zerobridge.clip_grad_norm_(model, clip if clip is not None else float("inf"))
        opt.step()
        result.stats.append(zerobridge.stats(model))
        opt.zero_grad()
        dist.all_reduce(total)
        result.losses.append(total.item() / world)
        result.grad_norms.append(norm.item())
    result.forward_calls = calls[0]
    with torch.no_grad():
        tokens, targets = batch(10_000, 0, global_batch)
        share = slice(rank * (global_batch // world), (rank + 1) * (global_batch // world))
        held_out = model(tokens[share], targets[share]).float().reshape(1)
        dist.all_reduce(held_out)
        result.eval_loss = held_out.item() / world
    result.state = {k: v.cpu().clone() for k, v in zerobridge.full_state_dict(model).items()}
    if backend == "fsdp":
        from torch.distributed.tensor import DTensor

        result.local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()
                        if isinstance(p, DTensor)}
        mesh = backend_of(model).mesh  # type: ignore[attr-defined]
        result.coordinate = tuple(mesh.get_coordinate() or ())
        result.approximations = zerobridge.stats(model)["approximations"]
    return result


def refusals(*, specs: dict[str, Any]) -> dict[str, str]:
    """The ``ConfigError`` text ``prepare(..., backend="fsdp")`` gives for each spec ("" when it prepares)."""

    out = {}
    for name, spec in specs.items():
        try:
            zerobridge.prepare(ParityNet(0), config=StrategySpec.model_validate(spec), backend="fsdp")
            out[name] = ""
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def misuse() -> dict[str, str]:
    """What ``prepare(..., backend="fsdp")`` says to a second prepare and to an optimizer that has stepped."""

    out = {}
    model = zerobridge.prepare(ParityNet(0), stage=3, backend="fsdp")
    for name, call in (("twice", lambda: zerobridge.prepare(model, stage=3, backend="fsdp")),
                       ("stepped", lambda: _stepped_then_prepared())):
        try:
            call()
            out[name] = ""
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def starts_from_rank0(*, backend: str) -> dict[str, torch.Tensor]:
    """Each rank builds ParityNet with its own seed; after ``prepare`` every rank holds rank 0's values."""

    model = zerobridge.prepare(ParityNet(dist.get_rank()), stage=3, backend=backend)
    return {k: v.clone() for k, v in zerobridge.full_state_dict(model).items()}


def _stepped_then_prepared() -> None:
    model = ParityNet(0)
    opt = make_optimizer(list(model.named_parameters()), "adamw")
    model(*batch(0, 0, 2)).backward()
    opt.step()
    zerobridge.prepare(model, opt, stage=3, backend="fsdp")


def _model(backend: str, seed: int, spec: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = ParityNet(seed)
    config = StrategySpec.model_validate(spec) if isinstance(spec, dict) else spec
    model = zerobridge.prepare(model, config=config, backend=backend)
    return model, make_optimizer(list(model.named_parameters()), "adamw")


def _clip(model: torch.nn.Module) -> None:
    zerobridge.clip_grad_norm_(model, 1.0)


def save_after(*, backend: str, spec: Any, path: str, steps: int) -> list[float]:
    """Train ``steps`` steps and save a checkpoint at ``path`` (metadata ``{"step": steps}``)."""

    model, optimizer = _model(backend, 0, spec)
    losses = train_steps(model, optimizer, range(steps), _clip)
    zerobridge.save_checkpoint(Path(path), model, optimizer, metadata={"step": steps})
    return losses


def resume(*, backend: str, spec: Any, path: str, stop: int) -> dict[str, Any]:
    """A fresh model (another seed, other hyperparameters) loads ``path`` and trains on to ``stop``."""

    model, optimizer = _model(backend, 7, spec)
    for group in optimizer.param_groups:  # the checkpoint must put the saved values back
        group["lr"], group["weight_decay"] = 1.0, 0.5
    metadata = zerobridge.load_checkpoint(Path(path), model, optimizer)
    losses = train_steps(model, optimizer, range(int(metadata["step"]), stop), _clip)
    return {"metadata": metadata, "losses": losses, "full": zerobridge.full_state_dict(model),
            "lr": [g["lr"] for g in optimizer.param_groups]}
