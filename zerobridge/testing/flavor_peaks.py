"""Peak live tensor bytes of one model trained under real DeepSpeed or the FSDP2 backend, several configs a launch.

    from zerobridge.harness.cluster import Cluster

    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ".cache/torch_extensions"}
    with Cluster(2, env=env) as cluster:
        ds = cluster.run("zerobridge.testing.flavor_peaks:deepspeed_peaks", model="tiny-llama",
                         configs={"zero3": ds_json}, micro_batch=2, seq_len=128)
    with Cluster(2) as cluster:
        fsdp = cluster.run("zerobridge.testing.flavor_peaks:fsdp_peaks", model="tiny-llama",
                           specs={"zero3": spec_json}, micro_batch=2, seq_len=128)
    ds[0]["zero3"]["train"] / fsdp[0]["zero3"]["train"]   # rank 0: DeepSpeed's peak over FSDP2's

Every rank runs each config in turn on a fresh model built with real values
inside a ``StorageTracker`` (the counter ``zerobridge plan`` uses), so
parameters, optimizer state, each flavor's own buffers and the activations
all count. Both flavors step the plan's optimizer (``optimizer``: torch AdamW
one tensor at a time unless told otherwise) on the plan's data (random tokens,
labels = inputs) for two steps: the first creates the optimizer state, the
second is the steady state.
``train`` is the highest of the forward, backward and step peaks; ``setup``
(building and wrapping the model) is returned apart, and ``rest``: the bytes
held once the second step is over (the state each flavor keeps between steps). One launch pays
DeepSpeed's import and op check once for all its configs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import zerobridge
from zerobridge.models import preset_named, tiny_gpt
from zerobridge.planning.candidates import with_checkpointing
from zerobridge.planning.fake_run import optimizer_for
from zerobridge.planning.models import ModelSource, resolve_model
from zerobridge.planning.tracker import StorageTracker
from zerobridge.runtime.unit_wrap import checkpointed
from zerobridge.runtime.wrap_units import unit_modules
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage

__all__ = ["deepspeed_peaks", "fsdp_peaks"]

TRAINING = ("forward", "backward", "step")
"""The phases whose peak is ``train``."""

Step = Callable[[torch.Tensor], None]
"""One micro-batch's forward, backward and optimizer step on the prepared model."""


def _tokens(source: ModelSource, micro_batch: int, seq_len: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, max(source.vocab_size, 2), (micro_batch, seq_len), generator=generator)


def _measured(tracker: StorageTracker, rest: int) -> dict[str, int]:
    """The peak of each phase, ``train`` (the highest of the training phases) and ``rest``."""
    peaks = dict(tracker.peaks)
    return {**peaks, "train": max(peaks.get(p, 0) for p in TRAINING), "rest": rest}


def _build(source: ModelSource, recompute: bool) -> nn.Module:
    preset = preset_named(source.name, key="model")
    # real values, on the CPU (the planner's source builds zerobridge's GPT on meta)
    model = tiny_gpt(preset, seed=0) if preset is not None else source.builder(None)
    if recompute and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()  # type: ignore[operator]
    elif recompute:  # zerobridge's GPT: each unit the plan's +ac candidates recompute, as the engines do
        wrap = with_checkpointing(spec_for_stage(2, model), model).wrapping
        for unit in unit_modules(model, wrap)[1:]:
            unit.forward = checkpointed(unit.forward)
    return model


def deepspeed_peaks(*, model: str, configs: dict[str, dict[str, Any]], micro_batch: int, seq_len: int,
                    recompute: tuple[str, ...] = (), optimizer: str = "adamw") -> dict[str, dict[str, int]]:
    """On every rank: each DeepSpeed JSON of ``configs`` run by ``deepspeed.initialize`` with the plan's
    ``optimizer`` (``fake_run.optimizer_for``) as its client optimizer; per config, this rank's peaks by
    phase and ``train``. Configs named in
    ``recompute`` recompute activations in the model (a DeepSpeed JSON cannot say it): a Hugging Face
    model through ``gradient_checkpointing_enable``, another one unit at a time as the plan's ``+ac``."""
    import deepspeed  # lazy: only DeepSpeed workers need it

    source = resolve_model(model)
    out: dict[str, dict[str, int]] = {}
    for name, config in configs.items():
        with StorageTracker() as tracker:
            built = _build(source, name in recompute)
            engine, *_ = deepspeed.initialize(model=built, optimizer=optimizer_for(built, optimizer),
                                               config=config)
            for step in range(2):
                tokens = _tokens(source, micro_batch, seq_len, step)
                tracker.phase = "forward"
                loss = source.loss(engine, tokens)
                tracker.phase = "backward"
                engine.backward(loss)
                del loss
                tracker.phase = "step"
                engine.step()
                tracker.phase = "setup"
            rest = tracker.live
            engine.destroy()
            del engine, built
            gc.collect()
        out[name] = _measured(tracker, rest)
    return out


def fsdp_peaks(*, model: str, specs: dict[str, dict[str, Any]], micro_batch: int, seq_len: int,
               clip: float | None = 1.0, approximate: bool = False, optimizer: str = "adamw"
               ) -> dict[str, dict[str, int]]:
    """On every rank: each spec of ``specs`` run by the FSDP2 backend (``zerobridge.prepare``) with the
    same optimizer, data and clipping; per spec, this rank's peaks by phase and ``train``.
    ``approximate``: a spec FSDP2 cannot run exactly (ZeRO-2) runs as its closest FSDP2 form, as
    ``zerobridge plan --flavor fsdp2`` measures it."""
    source = resolve_model(model)
    out: dict[str, dict[str, int]] = {}
    for name, spec in specs.items():
        with StorageTracker() as tracker:
            built = _build(source, recompute=False)  # the backend recomputes what the spec says
            prepared, stepped = zerobridge.prepare(built, optimizer_for(built, optimizer),
                                                   config=StrategySpec.model_validate(spec), backend="fsdp",
                                                   allow_approximate=approximate)
            for step in range(2):
                tokens = _tokens(source, micro_batch, seq_len, step)
                tracker.phase = "forward"
                loss = source.loss(prepared, tokens)
                tracker.phase = "backward"
                loss.backward()
                del loss
                tracker.phase = "step"
                if clip is not None:
                    zerobridge.clip_grad_norm_(prepared, clip)
                stepped.step()
                stepped.zero_grad(set_to_none=True)
                tracker.phase = "setup"
            rest = tracker.live
            del prepared, stepped, built
            gc.collect()
        out[name] = _measured(tracker, rest)
    return out
