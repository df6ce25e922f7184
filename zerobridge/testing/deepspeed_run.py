"""Train a model under real DeepSpeed ZeRO on an existing process group.

    from zerobridge.harness.cluster import Cluster

    if __name__ == "__main__":
        env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ".cache/torch_extensions"}
        with Cluster(2, env=env) as cluster:
            runs = cluster.run("zerobridge.testing.deepspeed_run:train_deepspeed",
                               stage=2, steps=6, save_dir="/tmp/ds", save_after=4)
            print(runs[0].losses, runs[0].tag)  # tag: "global_step4"

``train_deepspeed`` runs on every rank of a ``Cluster``: it builds the model
(``ParityNet`` unless ``model_factory`` names another), wraps it with
``deepspeed.initialize`` around a client ``torch.optim.AdamW`` with the param
groups and hyper-parameters of :mod:`zerobridge.testing.parity` (so DeepSpeed
never JIT-builds its own Adam), and trains on ``parity.batch`` with the global
batch split across ranks exactly as ``run_native`` splits it, so its losses
are comparable with ``parity.run_reference``.

ParityNet under DeepSpeed (stages 1-3, fp32 and bf16, checked): the frozen
layer stays out of the flat groups (stage 1 saves it only in the module
state dict, stages 2-3 also as frozen fragments) and the tied head weight is
recorded in ``shared_params``. The unused parameter sits in the flat groups
and gets a zero gradient, so AdamW's decoupled weight decay still shrinks
``unused.weight`` by ``(1 - lr * weight_decay)`` every step and its state is
zeros with ``step == steps``; plain torch skips a parameter whose grad is
None. That one parameter is the only difference from ``run_reference``.

``reference_adamw`` is the single-process plain-torch counterpart that also
returns the optimizer state per parameter name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.testing.parity import ParityNet, batch, make_optimizer

__all__ = ["AdamWReference", "BufferedParityNet", "DeepSpeedRun", "deepspeed_config", "reference_adamw",
           "train_deepspeed"]

STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""The per-parameter Adam state ``DeepSpeedRun.saved_optimizer`` gathers."""


@dataclass
class DeepSpeedRun:
    """What one rank of a DeepSpeed run reports."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tag: str | None = None
    """Checkpoint tag written after ``save_after`` steps (None when not saved)."""
    saved_params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full fp32 master value of every parameter when the checkpoint was written
    (frozen ones: their model value in fp32), from DeepSpeed's own live API."""
    saved_optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Full ``exp_avg`` / ``exp_avg_sq`` per trainable parameter at save time,
    from ``deepspeed.utils.safe_get_full_optimizer_state``."""
    final_params: dict[str, torch.Tensor] = field(default_factory=dict)
    """As ``saved_params``, after the last step."""


@dataclass
class AdamWReference:
    """A single-process plain-torch run: what a sharded run must hold."""

    state_dict: dict[str, torch.Tensor]
    """``model.state_dict()``: parameters under every name, persistent buffers."""
    optimizer: dict[str, dict[str, torch.Tensor]]
    """``optimizer.state`` by parameter name (parameters that were stepped)."""
    param_groups: list[dict[str, Any]]
    """Hyperparameters and ``params`` (names) of each optimizer group."""


class BufferedParityNet(ParityNet):
    """``ParityNet`` plus buffers: a float gain on the embedding output, a
    forward counter (int64: after training it equals the step count) and a
    non-persistent scratch buffer that no checkpoint may hold."""

    gain: torch.Tensor
    calls: torch.Tensor

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.register_buffer("gain", torch.linspace(0.9, 1.1, self.embed.embedding_dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        self.embed.register_forward_hook(self._apply_gain)

    def _apply_gain(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * self.gain.to(output.dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(tokens, targets)


def _build_model(model_factory: str | None, seed: int) -> nn.Module:
    if model_factory is None:
        return ParityNet(seed)
    module_name, _, attr = model_factory.partition(":")
    model: nn.Module = getattr(importlib.import_module(module_name), attr)(seed)
    return model


def deepspeed_config(*, stage: int, micro_batch: int, dtype: str = "fp32", clip: float | None = 1.0,
                     zero: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON these runs use: one micro-batch per step, no
    accumulation; ``zero`` adds ``zero_optimization`` keys, ``extra`` top-level ones."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip if clip is not None else 0.0,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
    } | (extra or {})


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 masters of trainable parameters, model values of frozen ones (collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        value = safe_get_full_fp32_param(param) if param.requires_grad else None
        if value is None:
            with deepspeed.zero.GatheredParameters([param]):
                value = param.detach().clone()
        out[name] = value.detach().float().cpu().clone()
    return out


def _full_optimizer_state(engine: Any, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Full ``STATE_KEYS`` of every trainable parameter (collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    # NOTE: DeepSpeed 0.19.8 stage 1/2 links parameters to their optimizer
    # state right after stepping param group 0, before torch AdamW created the
    # state of the later groups, so their parameters never find it ("exp_avg
    # not found in optimizer state fragment"). Link again now that all exist.
    if getattr(engine.optimizer, "_hp_optimizer_states_linked", None) is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    return {name: {key: safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
                   for key in STATE_KEYS}
            for name, param in model.named_parameters() if param.requires_grad}


def train_deepspeed(*, stage: int, steps: int = 10, dtype: str = "fp32", global_batch: int = 8,
                    clip: float | None = 1.0, seed: int = 0, save_dir: str | None = None,
                    save_after: int | None = None, model_factory: str | None = None,
                    zero: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                    client_state: dict[str, Any] | None = None, collect: bool = True) -> DeepSpeedRun:
    """On every rank: train ``steps`` steps under DeepSpeed ZeRO ``stage``.

    With ``save_dir``, ``engine.save_checkpoint(save_dir, client_state=...)``
    runs after ``save_after`` steps (default: the last). ``model_factory`` is
    ``"module:callable"`` taking the seed. ``collect=False`` skips gathering
    full values (stage 0 has no partitioned state to gather).
    """
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    if global_batch % world:
        raise ValueError(f"global_batch {global_batch} does not split over {world} ranks")
    save_after = steps if save_after is None else save_after
    model = _build_model(model_factory, seed)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    per_rank = global_batch // world
    config = deepspeed_config(stage=stage, micro_batch=per_rank, dtype=dtype, clip=clip, zero=zero, extra=extra)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    result = DeepSpeedRun()
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(steps):
        tokens, targets = batch(step, 0, global_batch)
        loss = engine(tokens[mine], targets[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        result.losses.append(total.item() / world)
        norm = engine.get_global_grad_norm()
        result.grad_norms.append(float(norm) if norm is not None else float("nan"))
        if save_dir is not None and step + 1 == save_after:
            engine.save_checkpoint(save_dir, client_state=client_state or {})
            result.tag = f"global_step{engine.global_steps}"
            if collect:
                result.saved_params = _full_params(engine.module)
                result.saved_optimizer = _full_optimizer_state(engine, engine.module)
    if collect:
        result.final_params = _full_params(engine.module)
    engine.destroy()
    return result


def reference_adamw(*, steps: int, global_batch: int = 8, clip: float | None = 1.0, seed: int = 0,
                    model_factory: str | None = None) -> AdamWReference:
    """One process, the whole batch, plain ``torch.optim.AdamW`` with parity's
    groups: the state ``steps`` steps of ``train_deepspeed`` must reach."""
    model = _build_model(model_factory, seed)
    named = list(model.named_parameters())
    optimizer = make_optimizer(named, "adamw")
    for step in range(steps):
        model(*batch(step, 0, global_batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        optimizer.step()
        optimizer.zero_grad()
    names: dict[torch.Tensor, str] = {p: n for n, p in named}
    return AdamWReference(
        state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer={names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
        param_groups=[{k: v for k, v in g.items() if k != "params"} | {"params": [names[p] for p in g["params"]]}
                      for g in optimizer.param_groups])
