"""DeepSpeed's memory, modelled: the native engine's fake run of the same layout, plus the buffers DeepSpeed adds.

    >>> from zerobridge.planning.deepspeed_memory import buffers_for
    >>> config = {"bf16": {"enabled": False},
    ...           "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}}
    >>> b = buffers_for(config, params=10_000, world_size=2)
    >>> b.master_copy, b.grad_partition, b.reduce_buckets, b.fp32_grad_copy
    (20000, 20000, 8000, 0)

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
   where they overlap the rest. Each is a named term of ``DeepSpeedBuffers``,
   sized from the JSON ``plan --to deepspeed`` writes for the candidate
   (``write_deepspeed``):

   - ``master_copy``: DeepSpeed keeps an fp32 master partition apart from the
     parameters even in an fp32 run (``single_partition_of_fp32_groups``,
     ``fp32_partitioned_groups_flat``); the native engine steps its fp32
     parameters in place, and in a mixed run holds the master as DeepSpeed does
     (no term). From setup on.
   - ``grad_partition``: the native engine's own gradient shard stands for
     DeepSpeed's gradient partition, with no term of its own. Stages 1-2: the
     contiguous partition (``grads_in_partition``) holds the backward's
     gradients until the step consumes them and is then freed; the native
     shard is freed after each step too (``FlatGroup.release_grads``), and in a
     16-bit run before the optimizer runs (the step casts the partition to
     fp32 first). DeepSpeed moves each gradient into its reduce bucket (a
     term) as it is produced, so the native run reduces its gradients in
     buckets of at most the largest parameter rather than holding the whole
     model's gradients in one buffer at the end of its backward (38.7 MiB
     above its resting state on the tiny Llama in fp32). Stage 3's flat
     gradient partition (``grad_partitions_flat_buffer``), from setup until
     the first backward.
     From there the native engine's gradient shard holds the same gradients
     and stands for it: the engine keeps that shard between steps (zeroed, not
     freed). Counting both held the gradients twice: in the backward (the 20M
     GPT's ZeRO-3 fp32 backward planned 26% over real DeepSpeed), and, with
     the partition added back after each step, through the next forward (the
     same model's forward planned 307.6 MiB against DeepSpeed's 269.7, one
     38.3 MiB partition over).
   - ``reduce_buckets``: stages 1-2 allocate ``reduce_bucket_size`` elements in
     the parameters' dtype when the first gradient of a micro-step is ready
     (``setup_buckets``), twice with ``overlap_comm``, and free them at the end
     of that backward. Stage 3 preallocates one flat bucket at setup
     (``__ipg_bucket_flat_buffer``) and keeps it. It flushes the bucket once
     the next gradient does not fit, and reduces a gradient larger than the
     bucket on its own (the JSON written for a known model sizes it to
     hidden_size^2), holding no reduction in flight: the native run of a
     stage-3 candidate lands each unit's reduction as it issues it
     (``ReductionQueue.limit`` 0). With the native engine's two in flight the
     model planned the 20M GPT's ZeRO-3 fp32 with checkpointing 15.6% over
     real DeepSpeed; landed at once, 5.5%.
   - ``fp32_grad_copy``: the flat fp32 gradient the optimizer steps: in a
     16-bit run the step casts the gradient partition to fp32
     (``single_grad_partition``); stage 3 flattens it in fp32 too
     (``_prepare_fp32_grad_for_sub_group``: ``flatten(...)`` is a copy).
   - ``adam_temporaries``: torch's AdamW steps DeepSpeed's one flat fp32
     partition, so its two temporaries (``exp_avg_sq.sqrt()`` and its quotient)
     are partition-sized, on top of the optimizer state and the fp32 gradient:
     where a real stage-3 bf16 run peaks (``stage3.py`` ``_optimizer_step``,
     measured: 30.0 MB above the live bytes after backward on the tiny Llama,
     the fp32 gradient and two temporaries of 10.0 MB each). At stage 3 both
     are one sub-group's (``largest_sub_group``): DeepSpeed steps its
     partition a sub-group at a time, and the JSON written for a known model
     sizes ``sub_group_size`` to the largest unit's partition.
   - ``persistent``: stage-3 parameters of at most
     ``stage3_param_persistence_threshold`` elements stay whole on every rank.
   - DeepSpeed's all-gather bucket allocates nothing of its own.

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
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zerobridge.backends.native.prepare import prepare
from zerobridge.engine import Engine
from zerobridge.errors import ConfigError
from zerobridge.planning.fake_run import FakeRunTracker, Measured, Run, fake_world, optimizer_for
from zerobridge.planning.models import ModelSource
from zerobridge.runtime.deferred_init import ShapeReplay
from zerobridge.runtime.wrap_units import bucket_sizes
from zerobridge.spec import OffloadDevice, ShardingSpec, StrategySpec
from zerobridge.translate.deepspeed_buckets import UNBOUNDED
from zerobridge.translate.deepspeed_write import write_deepspeed

__all__ = ["DeepSpeedBuffers", "buffers_for", "deepspeed_config", "largest_sub_group", "run_deepspeed"]

MODELLED_STAGES = (1, 2, 3)
NATIVE_STEP = "native step"
"""The tracker's phase for the native engine's own optimizer step: left out of the peaks."""


class DeepSpeedBuffers(BaseModel):
    """DeepSpeed's buffers beyond the native engine's, in bytes per rank (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int
    dtype_bytes: int
    """Bytes per element of the parameters (and gradients): 4 in fp32, 2 in bf16 or fp16."""
    master_copy: int
    grad_partition: int
    reduce_buckets: int
    """Stages 1-2: per micro-step, while the backward runs; stage 3: the one flat bucket, from setup on."""
    fp32_grad_copy: int
    adam_temporaries: int = 0
    """Torch AdamW steps DeepSpeed's one flat fp32 partition, so its temporaries are partition-sized:
    ``denom = exp_avg_sq.sqrt() / c`` holds two at once (the square root and the quotient), both
    counted. The native engine's own step temporaries (its per-tile fp32 casts and AdamW's on each
    shard) are not DeepSpeed's: the native step runs uncounted (``NATIVE_STEP``) and these terms
    stand for DeepSpeed's."""
    persistent: int = 0

    @property
    def resident(self) -> int:
        """Bytes held from setup on."""
        held = self.master_copy + self.persistent
        return held + (self.grad_partition + self.reduce_buckets if self.stage == 3 else 0)


def largest_sub_group(numels: list[int], *, world_size: int, sub_group_size: int) -> int:
    """Partition elements of the largest stage-3 sub-group, cut as DeepSpeed cuts them: parameters in
    order, each adding its partition (``ceil(numel / world_size)``), a sub-group closed once it holds
    ``sub_group_size`` or more (so it can pass the size by one parameter's partition)."""
    largest = filled = 0
    for part in (-(-n // world_size) for n in numels):
        filled += part
        if filled >= sub_group_size:
            largest, filled = max(largest, filled), 0
    return max(largest, filled)


def buffers_for(config: dict[str, Any], *, params: int, world_size: int,
                persistent_params: int = 0, sub_group: int | None = None) -> DeepSpeedBuffers:
    """The terms for a DeepSpeed JSON ``config`` training ``params`` parameters on ``world_size``
    ranks; ``persistent_params``: stage-3 elements kept whole (at most the persistence threshold each);
    ``sub_group``: the largest stage-3 sub-group's elements (``largest_sub_group``; the whole
    partition when not given): the step's fp32 gradient copy and AdamW's temporaries are its size."""
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    low = bool(config.get("bf16", {}).get("enabled")) or bool(config.get("fp16", {}).get("enabled"))
    size = 2 if low else 4
    part = -(-params // world_size)
    bucket = int(zero.get("reduce_bucket_size", 500_000_000))
    overlap = bool(zero.get("overlap_comm", stage == 3))
    copies = 2 if overlap and stage < 3 else 1
    shared = persistent_params - persistent_params // world_size
    stepped = min(part, sub_group) if stage == 3 and sub_group is not None else part
    return DeepSpeedBuffers(stage=stage, dtype_bytes=size, master_copy=0 if low else 4 * part,
                            grad_partition=size * part, reduce_buckets=copies * size * bucket,
                            fp32_grad_copy=4 * stepped if low or stage == 3 else 0, adam_temporaries=2 * 4 * stepped,
                            persistent=size * shared if stage == 3 else 0)


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


def run_deepspeed(source: ModelSource, spec: StrategySpec, run: Run, *, layers: int | None = None
                  ) -> tuple[Measured, DeepSpeedBuffers]:
    """Two fake steps of ``spec`` as DeepSpeed would hold them (module docstring), and the terms."""
    _refuse(spec)
    model = source.build(layers)
    config = deepspeed_config(spec, model, run.world_size)
    threshold = int(config["zero_optimization"].get("stage3_param_persistence_threshold", 0))
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    sub_group = largest_sub_group(numels, world_size=run.world_size,
                                  sub_group_size=int(config["zero_optimization"].get("sub_group_size", 10**9)))
    terms = buffers_for(config, params=sum(p.numel() for p in model.parameters()), world_size=run.world_size,
                        persistent_params=_persistent_params(model, threshold), sub_group=sub_group)
    if terms.stage == 1:
        spec = _stage1_as_stage2(spec, config)
    if terms.stage < 3:
        # DeepSpeed moves each gradient into its reduce bucket as it is produced (a larger one is reduced
        # from its own tensor), and the buckets are a term: the native run reduces its gradients in
        # buckets of at most the largest parameter, so it holds no whole-model gradient buffer beside them
        # (a bucket per parameter measured the same, and cost 0.5 s a candidate on a 7M model)
        spec = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"reduce_bucket": max(numels)})})
    live = config["zero_optimization"].get("stage3_max_live_parameters", UNBOUNDED)
    if terms.stage == 3 and spec.communication.max_live_parameters is None and live < UNBOUNDED:
        # the bound the writer sized from the model holds the native run's prefetch back as it holds DeepSpeed's
        spec = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"max_live_parameters": live})})
    with fake_world(run.world_size, run.ranks_per_node), FakeTensorMode(allow_non_fake_inputs=True), \
            FakeRunTracker() as tracker:
        prepare(model, None, spec, allow_approximate=False, replay=ShapeReplay(model), device=torch.device("cpu"))
        engine = model.__dict__["_zerobridge_engine"]
        assert isinstance(engine, Engine)
        engine.stepper.skip_repeats = True  # fake tensors: a step that repeats another is left out
        if terms.stage == 3:
            # DeepSpeed reduces a bucket of at most reduce_bucket_size elements (a larger gradient alone)
            # once the next gradient does not fit, and holds none in flight: the native run lands each
            # unit's reduction as it issues it
            engine.reductions.limit = 0
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
            # the native step's own temporaries are not DeepSpeed's: it runs apart, and DeepSpeed's flat
            # working set is counted on what it leaves (the optimizer state, the first step's included)
            tracker.phase = NATIVE_STEP
            optimizer.step()
            tracker.phase = "step"
            # stages 1-2 free their gradient partition with the step, where the native engine keeps the
            # shard that stood for it: a 16-bit step casts the partition to fp32 and drops it before the
            # optimizer runs, an fp32 step after
            early = terms.stage < 3 and terms.fp32_grad_copy > 0
            if early:
                _release_grads(engine, optimizer)
            working = torch.empty(terms.fp32_grad_copy + terms.adam_temporaries * (run.optimizer == "adamw"),
                                  dtype=torch.uint8)
            del working
            if terms.stage == 3:
                optimizer.zero_grad(set_to_none=True)
            elif not early:
                _release_grads(engine, optimizer)
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
