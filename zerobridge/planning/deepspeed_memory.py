"""DeepSpeed's memory, modelled: the native engine's fake run of the same layout, plus the buffers DeepSpeed adds.

Real DeepSpeed does not run on fake tensors: ``deepspeed.initialize`` moves the
module to its accelerator (``module.to(device)``), which cannot swap a fake
parameter (``_apply(): Couldn't swap Embedding.weight``, DeepSpeed 0.19.8,
torch 2.13), and it flattens and partitions parameters on real storage
besides. So a DeepSpeed candidate is measured in two parts (``run_deepspeed``):

1. the native engine trains two steps of the same layout on fake tensors
   (``fake_run``'s world and ``StorageTracker``): the activations, the
   parameter gathers of stage 3 (DeepSpeed's prefetch bucket and
   ``stage3_max_live_parameters`` are written from the same wrap units, one
   unit ahead; the native run is held to the same live bound), the
   parameters, the Adam moments and the gradient shard, with their lifetimes.
   Stage 1 runs stage 2's layout (``_stage1_as_stage2``:
   DeepSpeed's stage 1 holds stage 2's buffers). The native optimizer step runs
   uncounted (``NATIVE_STEP``): its temporaries (per-tile fp32 casts, AdamW's
   on each shard) are the native engine's, and DeepSpeed's own are terms;
2. fake tensors of DeepSpeed's own buffers are allocated and freed beside it at
   the moments DeepSpeed allocates and frees them, so the tracker counts them
   where they overlap the rest. Each is a named term of ``DeepSpeedBuffers``
   (``deepspeed_terms.py`` says what each holds and when), sized from the JSON
   ``plan --to deepspeed`` writes for the candidate (``write_deepspeed``).
   Where DeepSpeed's order differs from the native engine's, the native run is
   told: it makes its gradient shard at its first reduction, reduces buckets
   in the order they fill and holds none in flight (stages 1-2), and stage 1
   keeps the gradients DeepSpeed keeps (``kept_grads``).

    >>> from zerobridge.planning.candidates import deepspeed_form
    >>> from zerobridge.planning.deepspeed_memory import deepspeed_config
    >>> from zerobridge.planning.models import resolve_model
    >>> from zerobridge.spec.presets import spec_for_stage
    >>> model = resolve_model("tiny-llama").build()
    >>> zero2, _ = deepspeed_form(spec_for_stage(2, model), model, own=False)   # the plan's candidate
    >>> zero = deepspeed_config(zero2, model, world_size=2)["zero_optimization"]
    >>> zero["reduce_bucket_size"] == 256 * 256       # hidden_size^2, as Trainer fills "auto"
    True

DeepSpeed's stages 1-2 also keep a meta tensor per parameter
(``round_robin_bit16_meta``): shapes, no memory, and not counted
(``planning/tracker.py``).

Checked against real DeepSpeed (gloo, CPU accelerator, two AdamW steps,
``testing/flavor_peaks.py``, ``bench/plan_flavors.py``): the tiny Llama, a
Qwen2 config and the 20M GPT at world 2, stages 1 to 3, fp32 and bf16, with and
without activation checkpointing (docs/plan.md has the table and its errors;
``tests/test_plan_flavors.py`` asserts 10% on a subset). Stage 0 (no ZeRO
optimizer: DeepSpeed's BF16_Optimizer or the client optimizer), offload,
hybrid and hpZ layouts are not modelled: ``run_deepspeed`` refuses them with
``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerobridge.backends.native.prepare import prepare
from zerobridge.engine import Engine
from zerobridge.errors import ConfigError
from zerobridge.planning.deepspeed_terms import DeepSpeedBuffers, buffers_for, largest_sub_group, stage1_kept
from zerobridge.planning.fake_run import Measured, Run, fake_tracking, fake_world, optimizer_for
from zerobridge.planning.models import ModelSource
from zerobridge.runtime.deferred_init import ShapeReplay
from zerobridge.runtime.wrap_units import bucket_sizes
from zerobridge.spec import OffloadDevice, ShardingSpec, StrategySpec
from zerobridge.translate.deepspeed_buckets import UNBOUNDED
from zerobridge.translate.deepspeed_write import write_deepspeed

__all__ = ["deepspeed_config", "run_deepspeed"]

MODELLED_STAGES = (1, 2, 3)
NATIVE_STEP = "native step"
"""The tracker's phase for the native engine's own optimizer step: left out of the peaks."""


def _not_modelled(spec: StrategySpec) -> str | None:
    """What of ``spec`` DeepSpeed's model leaves out (``run_deepspeed`` refuses it), or ``None``."""
    if int(spec.sharding.stage) not in MODELLED_STAGES:
        return f"stage {int(spec.sharding.stage)}"
    if OffloadDevice.NONE is not spec.offload.optimizer.device or \
            OffloadDevice.NONE is not spec.offload.parameters.device:
        return "offload"
    if spec.sharding.shard_group != "world" or spec.sharding.backward_gather_group is not None:
        return "hybrid and hpZ groups"
    return None


def _refuse(spec: StrategySpec) -> None:
    why = _not_modelled(spec)
    if why is not None:
        raise ConfigError(f"{why}: DeepSpeed's memory is modelled for stages 1 to 3 on one group, without "
                          "offload", key="--flavor",
                          fix="plan it with --flavor native or fsdp2, or measure it on real DeepSpeed")


def _stage1_as_stage2(spec: StrategySpec, config: dict[str, Any]) -> StrategySpec:
    """The layout whose native run holds what DeepSpeed's stage 1 holds: stage 2's. With ``overlap_comm``
    or ``contiguous_gradients`` (DeepSpeed's default), DeepSpeed's stage 1 moves each gradient into the
    reduce bucket as it is produced (the parameter's ``.grad`` becomes a view of the bucket) and copies
    the rank's own partition into ``grads_in_partition``: the same buffers as stage 2, and no full
    gradient kept (measured: the same peak as stage 2 in 7 of 8 cells, 1.2% under in the eighth).
    Without either, or with gradient accumulation (stage 1 reduces at the boundary only, so the full
    gradients of the other micro-steps stay), it keeps full gradients: not modelled."""
    zero = config.get("zero_optimization", {})
    if int(config.get("gradient_accumulation_steps", 1)) > 1:
        raise ConfigError("stage 1 with gradient accumulation: DeepSpeed keeps every full gradient between "
                          "boundaries, which the model does not hold", key="--flavor",
                          fix="plan it with --flavor native, or with --accumulation 1")
    if not (zero.get("overlap_comm", False) or zero.get("contiguous_gradients", True)):
        raise ConfigError("stage 1 without overlap_comm or contiguous_gradients: DeepSpeed's memory is modelled "
                          "for stage 1 with its gradients moved into the reduce buckets", key="--flavor",
                          fix="plan it with --flavor native, or turn contiguous_gradients on")
    sharding = ShardingSpec.model_validate(spec.sharding.model_dump() | {"gradients": True})
    return spec.model_copy(update={"sharding": sharding})


def deepspeed_config(spec: StrategySpec, model: nn.Module, world_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON ``plan --to deepspeed`` writes for ``spec`` on ``model`` (on ``world_size`` ranks)."""
    return write_deepspeed(spec, bucket_sizes(model, spec, world_size=world_size)).value


def _persistent_params(model: nn.Module, threshold: int) -> int:
    return sum(p.numel() for p in model.parameters() if p.numel() <= threshold)


def _release_grads(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    """Free the native engine's gradient shards until the next backward makes them again, zeroed (a
    parameter's gradient is a view of its shard, so those are cleared first)."""
    optimizer.zero_grad(set_to_none=True)
    for group in engine.groups:
        group.release_grads()


def _first_gradient_hooks(model: nn.Module, fire: Callable[[], None]) -> None:
    """Call ``fire`` when a gradient of a module with parameters is ready (the hook sits on the
    module's input: its backward node computes the parameters' gradients as well)."""

    def on_grad(grad: torch.Tensor) -> None:
        fire()

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if torch.is_grad_enabled():
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    arg.register_hook(on_grad)

    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_hook(hook)


def _kept_grad_hooks(engine: Engine, kept: set[int], size: int) -> list[torch.Tensor]:
    """A list that gets stage 1's kept gradient (``kept_grads``) of each parameter whose id (before
    ``prepare``) is in ``kept`` once its bucket's gradient is ready; the caller clears it at the step.
    Such a parameter is larger than the reduce bucket the native run is cut in, so its bucket is its own."""
    held: list[torch.Tensor] = []
    for group in engine.trainable:
        for b, bucket in enumerate(group.layout.buckets):
            numel = sum(group.refs[i].numel for i in bucket.params if group.refs[i].source_id in kept)
            if numel:
                group.leaves[b].register_post_accumulate_grad_hook(
                    lambda leaf, n=numel: held.append(torch.empty(n * size, dtype=torch.uint8)))
    return held


def run_deepspeed(source: ModelSource, spec: StrategySpec, run: Run, *, layers: int | None = None
                  ) -> tuple[Measured, DeepSpeedBuffers]:
    """Two fake steps of ``spec`` as DeepSpeed would hold them (module docstring), and the terms."""
    _refuse(spec)
    model = source.build(layers)
    config = deepspeed_config(spec, model, run.world_size)
    threshold = int(config["zero_optimization"].get("stage3_param_persistence_threshold", 0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    numels = [p.numel() for p in trainable]
    sub_group = largest_sub_group(numels, world_size=run.world_size,
                                  sub_group_size=int(config["zero_optimization"].get("sub_group_size", 10**9)))
    bucket = int(config["zero_optimization"].get("reduce_bucket_size", 500_000_000))  # as buffers_for reads it
    kept = stage1_kept(numels, world_size=run.world_size, bucket=bucket)
    terms = buffers_for(config, params=sum(p.numel() for p in model.parameters()), world_size=run.world_size,
                        persistent_params=_persistent_params(model, threshold), sub_group=sub_group,
                        kept=sum(numels[i] for i in kept))
    kept_ids = {id(trainable[i]) for i in kept} if terms.kept_grads else set()
    if terms.stage == 1:
        spec = _stage1_as_stage2(spec, config)
    if terms.stage < 3:
        # DeepSpeed moves each gradient into its reduce bucket as it is produced (a larger one is reduced
        # from its own tensor), and the buckets are a term: the native run is cut in buckets of the same
        # size, so it holds no whole-model gradient buffer beside them
        spec = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"reduce_bucket": bucket})})
    live = config["zero_optimization"].get("stage3_max_live_parameters", UNBOUNDED)
    if terms.stage == 3 and spec.communication.max_live_parameters is None and live < UNBOUNDED:
        # the bound the writer sized from the model holds the native run's prefetch back as it holds DeepSpeed's
        spec = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"max_live_parameters": live})})
    with fake_world(run.world_size, run.ranks_per_node), fake_tracking() as tracker:
        prepare(model, None, spec, allow_approximate=False, replay=ShapeReplay(model), device=torch.device("cpu"))
        engine = model.__dict__["_zerobridge_engine"]
        assert isinstance(engine, Engine)
        engine.stepper.skip_repeats = True  # fake tensors: a step that repeats another is left out
        # DeepSpeed reduces a bucket of at most reduce_bucket_size elements (a larger gradient alone)
        # once the next gradient does not fit, and holds none in flight beyond its buckets (a term): the
        # native run lands each reduction as it issues it
        engine.reductions.limit = 0
        if terms.stage < 3:
            # stages 1-2 reduce each bucket as it fills and make the gradient partition at its first
            # gradient, not as backward opens
            engine.reductions.arrival = True
            for group in engine.groups:
                group.defer_store = True
        optimizer = optimizer_for(model, run.optimizer)
        # stage 3's flat gradient partition: held until the first backward, where the native gradient
        # shard, kept from then on, starts to stand for it (counting both held the gradient twice)
        flat_grads = terms.grad_partition if terms.stage == 3 else 0
        held = [torch.empty(terms.resident - flat_grads, dtype=torch.uint8)]
        grad_buffer = [torch.empty(flat_grads, dtype=torch.uint8)]
        buckets: list[torch.Tensor] = []
        armed = [False]

        def first_gradient() -> None:
            if armed[0]:
                armed[0] = False
                buckets.append(torch.empty(terms.reduce_buckets, dtype=torch.uint8))

        _first_gradient_hooks(model, first_gradient)
        kept_grads = _kept_grad_hooks(engine, kept_ids, terms.dtype_bytes)
        generator = torch.Generator().manual_seed(0)
        for step in range(2):
            if step == 1:
                engine.stats.reset()
            for _ in range(run.accumulation):
                tokens = torch.randint(0, max(source.vocab_size, 2), (run.micro_batch, run.seq_len),
                                       generator=generator)
                tracker.phase = "forward"
                loss = source.loss(model, tokens) / run.accumulation
                tracker.phase = "backward"
                armed[0] = terms.stage < 3
                grad_buffer.clear()
                loss.backward()
                del loss, tokens
                buckets.clear()
            kept_grads.clear()  # before DeepSpeed's step (measured: its step peaks as stage 2's)
            # the native step's own temporaries are not DeepSpeed's: it runs apart, and DeepSpeed's flat
            # working set is counted on what it leaves (the optimizer state, the first step's included)
            tracker.phase = NATIVE_STEP
            if step == 0:  # it makes the optimizer state; a second one would change nothing counted
                optimizer.step()
            tracker.phase = "step"
            temporaries = terms.adam_temporaries * (run.optimizer == "adamw")
            if terms.stage < 3:
                # the flat copy (16-bit: and its fp32 cast) beside the partition, which the native shard
                # stands for; then the partition is freed (the native engine would keep its shard), a
                # 16-bit copy with it, and the optimizer runs on the fp32 gradient
                flat = [torch.empty(terms.flat_copy, dtype=torch.uint8)]
                cast = torch.empty(terms.fp32_grad_copy, dtype=torch.uint8)
                _release_grads(engine, optimizer)
                if terms.fp32_grad_copy:
                    flat.clear()
                working = torch.empty(temporaries, dtype=torch.uint8)
                del flat, cast, working
            else:
                working = torch.empty(terms.fp32_grad_copy + temporaries, dtype=torch.uint8)
                del working
                optimizer.zero_grad(set_to_none=True)
        del held, grad_buffer
        memory = engine.memory()
        stats = engine.stats
    peaks = {k: v for k, v in tracker.peaks.items() if k != NATIVE_STEP}
    measured = Measured(peaks=peaks, tiers=dict(memory["tier_bytes"]),
                        model_states={"params": memory["param_bytes"], "grads": memory["grad_bytes"],
                                      "optimizer": memory["optimizer_bytes"]},
                        comm_bytes={k: int(v) for k, v in stats.bytes.items() if v},
                        comm_calls={k: int(v) for k, v in stats.calls.items() if v})
    return measured, terms
