"""Spec -> DeepSpeed JSON, with every effective value written explicitly.

    >>> from zerobridge.spec import StrategySpec, ShardingSpec
    >>> from zerobridge.translate.deepspeed_write import write_deepspeed
    >>> t = write_deepspeed(StrategySpec(sharding=ShardingSpec.for_stage(3)))
    >>> t.value["zero_optimization"]["stage"], t.value["gradient_clipping"], t.value["train_micro_batch_size_per_gpu"]
    (3, 0.0, 'auto')

DeepSpeed's defaults have moved between releases (clipping 0.0 -> 1.0,
pin_memory false -> true), so the output never relies on one: each key the
spec decides is written. Keys DeepSpeed would reject (its sections forbid
unknown keys; the keys it removed, ``[removed]`` in ``mappings/deepspeed.toml``,
make it raise) are never emitted. Buckets the spec leaves to the engine
(``per_unit``, FSDP's one collective per unit) are sized for the model when
``sizes`` is given, else written ``"auto"`` where HF Trainer and Accelerate
fill them, never as DeepSpeed's 5e8 defaults (``deepspeed_buckets.py``); with
``sizes``, a stated reduce bucket larger than the whole model is written at the
model's size (the same reductions, without the preallocated rest).
"""

from __future__ import annotations

import math
from typing import Any

from zerobridge.spec import (
    AUTO,
    BackwardPrefetch,
    DType,
    DynamicLossScale,
    EveryModuleWrap,
    GradSync,
    ParamSharding,
    StaticLossScale,
    StrategySpec,
    is_auto,
)
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.spec.stage import Stage
from zerobridge.translate.carried import report_carried
from zerobridge.translate.compilation import write_deepspeed_compile
from zerobridge.translate.compute_copy import write_compute_copy
from zerobridge.translate.deepspeed_buckets import UNBOUNDED, BucketSizes, bucket_value, gathered_live, stepped_in
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Impact, Report, Status, Translation
from zerobridge.translate.wire import write_deepspeed_wire

__all__ = ["write_deepspeed"]

FORMAT = "deepspeed"


def write_deepspeed(spec: StrategySpec, sizes: BucketSizes | None = None) -> Translation[dict[str, Any]]:
    """The DeepSpeed config that runs ``spec`` as closely as DeepSpeed can; ``sizes``: the buckets for
    the model it will train, where the spec leaves them to the engine (``deepspeed_buckets.py``)."""
    report = Report(source="spec", target=FORMAT)
    stage = _stage(spec, report)
    zero: dict[str, Any] = {"stage": stage.value}
    _groups(spec, stage, zero, report)
    _offload(spec, stage, zero, report, sizes)
    _communication(spec, stage, zero, report, sizes)
    write_deepspeed_wire(spec, stage, zero, report)
    _wrapping(spec, stage, zero, report)
    out: dict[str, Any] = {}
    _batch(spec, stage, out, report)
    out.update(_precision(spec, report))
    out["zero_optimization"] = zero
    _checkpoint(spec, stage, zero, report)
    if "train_batch_size" in out and spec.batch.global_batch_size is None:
        report.add("sharding.world_size", Status.EQUIVALENT, f"DeepSpeed takes the world size from the launcher; "
                   f"train_batch_size = micro-batch x accumulation x {spec.sharding.world_size} fixes it",
                   target="train_batch_size")
    elif spec.sharding.world_size is not None:
        report.add("sharding.world_size", Status.EQUIVALENT,
                   f"DeepSpeed takes the world size ({spec.sharding.world_size}) from the launcher "
                   f"(deepspeed --num_gpus, torchrun --nproc-per-node, accelerate launch --num_processes)")
    _passthrough(spec, out, report)
    write_deepspeed_compile(spec, report)
    return Translation(out, report)


def _stage(spec: StrategySpec, report: Report) -> Stage:
    sharding = spec.sharding
    if sharding.parameters is ParamSharding.RESHARD_AFTER_BACKWARD:
        if spec.offload.parameters.enabled:
            report.add("sharding.parameters", Status.APPROXIMATED,
                       "reshard_after_backward with parameter offload -> stage 3: DeepSpeed offloads parameters "
                       "only at stage 3, which gathers them again for backward (more traffic)",
                       target="zero_optimization.stage")
            return Stage.PARAMETERS
        report.add("sharding.parameters", Status.APPROXIMATED,
                   "reshard_after_backward (SHARD_GRAD_OP) -> stage 2: same math and traffic, but DeepSpeed keeps "
                   "full parameters on every rank between steps (more memory at rest)",
                   target="zero_optimization.stage")
        return Stage.GRADIENTS
    report.add("sharding", Status.EXACT, f"stage {sharding.stage.value}", target="zero_optimization.stage")
    return sharding.stage


def _groups(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report) -> None:
    sharding = spec.sharding
    if sharding.is_hybrid:
        if stage is not Stage.PARAMETERS:
            report.add("sharding.shard_group", Status.APPROXIMATED,
                       f"DeepSpeed has no hybrid form below stage 3 (MiCS is stage 3 only); stage {stage.value} "
                       "shards over the whole world instead", target="zero_optimization")
        elif isinstance(sharding.shard_group, int) and sharding.backward_gather_group is None:
            # DeepSpeed 0.19.8 removed MiCS (mics_shard_size now raises), so
            # hybrid sharding has no DeepSpeed form left. hpZ over the same
            # group keeps the backward gathers inside it.
            zero["zero_hpz_partition_size"] = sharding.shard_group
            report.add("sharding.shard_group", Status.APPROXIMATED,
                       f"DeepSpeed removed MiCS in 0.19.8; written as ZeRO++ hpZ over groups of "
                       f"{sharding.shard_group}: states are sharded over the whole world (less memory), "
                       "forward gathers cross groups (more inter-group traffic)",
                       target="zero_optimization.zero_hpz_partition_size")
        else:
            report.add("sharding.shard_group", Status.NOT_EXPRESSIBLE,
                       f"DeepSpeed removed MiCS in 0.19.8 and has no other hybrid form for shard group "
                       f"{sharding.shard_group!r}", target="zero_optimization")
    group = sharding.backward_gather_group
    if isinstance(group, int):
        zero["zero_hpz_partition_size"] = group
        report.add("sharding.backward_gather_group", Status.EXACT, "ZeRO++ hpZ",
                   target="zero_optimization.zero_hpz_partition_size")
    elif group == "node":
        report.add("sharding.backward_gather_group", Status.NOT_EXPRESSIBLE,
                   "'node' needs a number for zero_hpz_partition_size: state the ranks per node",
                   target="zero_optimization.zero_hpz_partition_size")


def _offload(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report,
             sizes: BucketSizes | None) -> None:
    opt, par = spec.offload.optimizer, spec.offload.parameters
    if opt.enabled:
        section: dict[str, Any] = {"device": opt.device.value, "pin_memory": opt.pin_memory}
        if opt.device.value == "nvme":
            section.update(nvme_path=opt.nvme_path, buffer_count=opt.buffer_count,
                           pipeline_read=opt.pipeline_read, pipeline_write=opt.pipeline_write)
        if opt.ratio < 1.0:
            section["ratio"] = opt.ratio
        zero["offload_optimizer"] = section
        report.add("offload.optimizer", Status.EXACT, target="zero_optimization.offload_optimizer")
    if par.enabled:
        section = {"device": par.device.value, "pin_memory": par.pin_memory}
        if par.device.value == "nvme":
            section.update(nvme_path=par.nvme_path, buffer_count=par.buffer_count,
                           buffer_size=par.buffer_size, max_in_cpu=par.max_in_cpu)
        zero["offload_param"] = section
        report.add("offload.parameters", Status.EXACT, target="zero_optimization.offload_param")
    zero["sub_group_size"] = spec.offload.sub_group_size
    default = type(spec.offload).model_fields["sub_group_size"].default
    comm = spec.communication
    left = "per_unit" in (comm.reduce_bucket, comm.allgather_bucket, comm.prefetch_bucket)  # buckets left to us
    if sizes is not None and left and stage is Stage.PARAMETERS and not opt.enabled \
            and spec.offload.sub_group_size == default:
        # the source steps one parameter at a time; DeepSpeed's default steps the whole partition at once
        zero["sub_group_size"] = sizes.sub_group
        ranks = sizes.ranks
        report.add("offload.sub_group_size", Status.APPROXIMATED,
                   f"FSDP steps one parameter at a time; DeepSpeed steps its flat partition in sub-groups: sized "
                   f"to the partition of {sizes.basis} on {f'{ranks} ranks' if ranks else 'one rank'} "
                   f"({zero['sub_group_size']:,} elements): {stepped_in(zero['sub_group_size'])}",
                   target="zero_optimization.sub_group_size", impact=Impact.MEMORY)


def _communication(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report,
                   sizes: BucketSizes | None) -> None:
    comm = spec.communication
    zero["overlap_comm"] = comm.overlap_reduce
    # Every key is written at every stage (DeepSpeed accepts them all), so a
    # config read back gives the same numbers; only the ones the stage uses are
    # reported when they had to be approximated. A per_unit bucket reads back
    # as the size written for it (or "auto"): DeepSpeed has no per-unit form.
    zero["reduce_bucket_size"] = bucket_value(spec, stage, "reduce_bucket", "reduce_bucket_size", report, sizes,
                                              used=stage is not Stage.NONE or comm.overlap_reduce)
    zero["allgather_bucket_size"] = bucket_value(spec, stage, "allgather_bucket", "allgather_bucket_size", report,
                                                 sizes, used=stage in (Stage.OPTIMIZER, Stage.GRADIENTS))
    sharded = stage is Stage.PARAMETERS
    prefetch = bucket_value(spec, stage, "prefetch_bucket", "stage3_prefetch_bucket_size", report, sizes, used=sharded)
    no_prefetch = not comm.forward_prefetch and comm.backward_prefetch is BackwardPrefetch.NONE
    if sharded and no_prefetch:
        prefetch = 0
        report.add("communication.backward_prefetch", Status.EXACT, "no prefetching: prefetch bucket 0",
                   target="zero_optimization.stage3_prefetch_bucket_size")
    elif sharded and (not comm.forward_prefetch or comm.backward_prefetch is not BackwardPrefetch.BEFORE_GRAD):
        report.add("communication.backward_prefetch", Status.APPROXIMATED,
                   f"DeepSpeed prefetches forward and backward alike, ahead of use (asked: forward "
                   f"{comm.forward_prefetch}, backward {comm.backward_prefetch.value})",
                   target="zero_optimization.stage3_prefetch_bucket_size")
    zero["stage3_prefetch_bucket_size"] = prefetch
    zero["stage3_param_persistence_threshold"] = comm.persistence_threshold
    if comm.model_persistence_threshold is not None:
        zero["stage3_model_persistence_threshold"] = comm.model_persistence_threshold
    for name, key in (("max_live_parameters", "stage3_max_live_parameters"),
                      ("max_reuse_distance", "stage3_max_reuse_distance")):
        value = getattr(comm, name)
        if value is None and name == "max_live_parameters" and sharded and sizes is not None \
                and comm.prefetch_bucket == "per_unit":
            value = sizes.live
            report.add("communication.max_live_parameters", Status.APPROXIMATED,
                       f"FSDP holds the unit it computes and the one it prefetches, then frees them; DeepSpeed "
                       f"bounds gathered parameters by elements, and without a bound prefetches as far as "
                       f"stage3_prefetch_bucket_size reaches: sized to {sizes.basis}: "
                       f"{gathered_live(value, dtype=spec.precision.param_dtype)}",
                       target=f"zero_optimization.{key}", impact=Impact.MEMORY)
        elif value is None:
            value = 0 if name == "max_reuse_distance" else UNBOUNDED
            if sharded:
                report.add(f"communication.{name}", Status.EQUIVALENT,
                           "no bound / no reuse written as " + str(value), target=f"zero_optimization.{key}")
        zero[key] = value
    if comm.max_inflight_gathers is not None and sharded:
        report.add("communication.max_inflight_gathers", Status.NOT_EXPRESSIBLE,
                   "DeepSpeed bounds gathered parameters by elements (stage3_max_live_parameters), not units "
                   "in flight")


def _wrapping(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report) -> None:
    wrap = spec.wrapping
    if isinstance(wrap, EveryModuleWrap):
        if wrap.leaf_classes and stage is Stage.PARAMETERS:
            zero["leaf_module"] = {"classes": list(wrap.leaf_classes)}
        return
    if stage is Stage.PARAMETERS:
        report.add("wrapping", Status.APPROXIMATED,
                   f"DeepSpeed gathers every submodule on its own (policy {wrap.policy!r} has no DeepSpeed form); "
                   "same math, different gather granularity")


def _precision(spec: StrategySpec, report: Report) -> dict[str, Any]:
    p = spec.precision
    out: dict[str, Any] = {}
    auto = is_auto(p.param_dtype)
    scaling = p.loss_scaling
    # "auto" comes back as exactly the sections that may switch on: an "auto" section the
    # source never had would let HF Trainer's --bf16 / --fp16 turn it on.
    fp16_auto = auto and DType.FP16 in p.auto_choices and scaling.kind != "none"
    fp16: dict[str, Any] = {"enabled": AUTO if fp16_auto else p.param_dtype == DType.FP16}
    bf16: dict[str, Any] = {"enabled": AUTO if auto and DType.BF16 in p.auto_choices else p.param_dtype == DType.BF16}
    if isinstance(scaling, StaticLossScale):
        fp16["loss_scale"] = scaling.scale
    elif isinstance(scaling, DynamicLossScale):
        power = math.log2(scaling.initial_scale)
        if not power.is_integer():
            report.add("precision.loss_scaling.initial_scale", Status.APPROXIMATED,
                       f"DeepSpeed starts at a power of two: 2^{round(power)} instead of {scaling.initial_scale}")
        fp16.update(loss_scale=0, initial_scale_power=round(power), loss_scale_window=scaling.growth_interval,
                    hysteresis=scaling.hysteresis, consecutive_hysteresis=scaling.consecutive_hysteresis,
                    min_loss_scale=max(scaling.min_scale, 1))
        if scaling.min_scale < 1:
            report.add("precision.loss_scaling.min_scale", Status.APPROXIMATED,
                       f"DeepSpeed's floor must be at least 1 (asked {scaling.min_scale})",
                       target="fp16.min_loss_scale")
        if scaling.growth_factor != 2.0 or scaling.backoff_factor != 0.5:
            report.add("precision.loss_scaling", Status.NOT_EXPRESSIBLE,
                       "DeepSpeed doubles and halves the scale; growth/backoff factors "
                       f"{scaling.growth_factor}/{scaling.backoff_factor} cannot be set")
    if p.master_dtype != DType.FP32 and not auto:
        flag = "fp16_master_weights_and_grads" if p.param_dtype == DType.FP16 else "bf16_master_weights_and_grads"
        (fp16 if p.param_dtype == DType.FP16 else bf16)[flag] = True
    if p.param_dtype == DType.BF16 or auto:
        bf16["check_grad_overflow"] = p.skip_nonfinite_steps
    elif p.param_dtype == DType.FP16 and not p.skip_nonfinite_steps:
        report.add("precision.skip_nonfinite_steps", Status.NOT_EXPRESSIBLE,
                   "DeepSpeed fp16 always skips steps whose gradients overflow")
    elif p.param_dtype == DType.FP32 and p.skip_nonfinite_steps:
        report.add("precision.skip_nonfinite_steps", Status.NOT_EXPRESSIBLE,
                   "DeepSpeed skips non-finite steps only in fp16/bf16 mode")
    out["fp16"], out["bf16"] = fp16, bf16
    write_compute_copy(report, p, "deepspeed", target="fp16" if p.param_dtype == DType.FP16 else "bf16")
    if not is_auto(p.reduce_dtype):
        out["communication_data_type"] = p.reduce_dtype.value
    elif not auto:
        report.add("precision.reduce_dtype", Status.AUTO, "left to DeepSpeed: the compute dtype")
    data_types: dict[str, Any] = {}
    if not is_auto(p.accumulate_dtype):
        data_types["grad_accum_dtype"] = p.accumulate_dtype.value
    if p.buffer_dtype is not None:
        data_types["buffer_dtype"] = p.buffer_dtype.value
    if data_types:
        out["data_types"] = data_types
    return out


def _batch(spec: StrategySpec, stage: Stage, out: dict[str, Any], report: Report) -> None:
    b = spec.batch
    world = spec.sharding.world_size
    if b.global_batch_size is not None:
        out["train_batch_size"] = b.global_batch_size
    elif world is not None and isinstance(b.micro_batch_size, int) and isinstance(b.accumulation_steps, int):
        out["train_batch_size"] = b.micro_batch_size * b.accumulation_steps * world
    if b.micro_batch_size is not None:
        out["train_micro_batch_size_per_gpu"] = b.micro_batch_size
    elif b.global_batch_size is None:
        out["train_micro_batch_size_per_gpu"] = AUTO
        report.add("batch.micro_batch_size", Status.AUTO,
                   "no batch size in the spec: written as \"auto\", which HF Trainer and Accelerate fill; for plain "
                   "deepspeed.initialize pass --micro-batch N to zerobridge convert",
                   target="train_micro_batch_size_per_gpu")
    if b.accumulation_steps is not None:
        out["gradient_accumulation_steps"] = b.accumulation_steps
    out["gradient_clipping"] = 0.0 if b.clip_grad_norm is None else b.clip_grad_norm
    if is_auto(b.clip_grad_norm):
        report.add("batch.clip_grad_norm", Status.AUTO, "\"auto\": HF Trainer fills it from --max_grad_norm; for "
                   "plain deepspeed.initialize pass --clip to zerobridge convert", target="gradient_clipping")
    else:
        report.add("batch.clip_grad_norm", Status.EXACT,
                   "written explicitly (DeepSpeed's default is 1.0 since 0.19.3)", target="gradient_clipping")
    for name, key in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                      ("accumulation_steps", "gradient_accumulation_steps"), ("global_batch_size", "train_batch_size")):
        if is_auto(getattr(b, name)):
            report.add(f"batch.{name}", Status.AUTO, "\"auto\": HF Trainer and Accelerate fill it from the same "
                       "arguments in both flavors; for plain deepspeed.initialize pass --micro-batch / --accumulation "
                       "to zerobridge convert", target=key)
    ds_sync = GradSync.ACCUMULATION_BOUNDARY if stage <= Stage.OPTIMIZER else GradSync.EVERY_MICRO_STEP
    if b.grad_sync is not ds_sync:
        report.add("batch.grad_sync", Status.EQUIVALENT,
                   f"DeepSpeed stage {stage.value} reduces {ds_sync.value.replace('_', ' ')}: same gradients, "
                   "different traffic and memory under accumulation")


def _checkpoint(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report) -> None:
    fmt = spec.checkpoint.format
    key = "stage3_gather_16bit_weights_on_model_save"
    if is_auto(fmt):
        zero[key] = AUTO
    elif fmt is CheckpointFormat.FULL:
        zero[key] = True
        report.add("checkpoint.format", Status.APPROXIMATED,
                   "DeepSpeed consolidates weights only in 16 bits and without optimizer state; its training "
                   "checkpoint stays sharded (zero_to_fp32.py makes a full fp32 one)",
                   target=f"zero_optimization.{key}")
    elif stage is Stage.PARAMETERS or fmt is CheckpointFormat.CONSOLIDATED_16BIT:
        zero[key] = fmt is CheckpointFormat.CONSOLIDATED_16BIT
    if spec.checkpoint.activation_checkpointing:
        report.add("checkpoint.activation_checkpointing", Status.NOT_EXPRESSIBLE,
                   "DeepSpeed's config only tunes its checkpointing API; enable recomputation in the model "
                   "(e.g. gradient_checkpointing_enable())")


def _passthrough(spec: StrategySpec, out: dict[str, Any], report: Report) -> None:
    removed = load_table(FORMAT).removed
    for path, value in spec.passthrough.get(FORMAT, {}).items():
        if path in removed:  # a spec written by hand can still carry one
            report.add(path, Status.NOT_EXPRESSIBLE, f"DeepSpeed removed it and raises on it: {removed[path]}; "
                                                     "not written")
            continue
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, value)
        report.add(path, Status.NOT_ABOUT_SHARDING, "carried verbatim")
    report_carried(spec, report, own=FORMAT, target="a DeepSpeed config", trainer=False)
