"""DeepSpeed JSON -> spec, read the way DeepSpeed reads it.

    >>> from zerobridge.translate.sources import Located
    >>> from zerobridge.translate.deepspeed_read import read_deepspeed
    >>> t = read_deepspeed(Located({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, "ds.json"))
    >>> t.value.summary()
    'stage 2, params replicated, compute bf16'
    >>> t.report.find("gradient_clipping").note.split(";")[0]
    'absent: DeepSpeed clips at 1.0 by default since 0.19.3'

What DeepSpeed does and this reader mirrors: hjson syntax, duplicate keys
rejected, ``1e9`` accepted for integers, ``stage3_*`` and unprefixed aliases
(both given is an error), deprecated keys mapped to their replacements,
unknown keys inside the strictly validated sections rejected, ``"auto"`` kept.
Where DeepSpeed silently ignores something (offload_param below stage 3, a
misspelled top-level key) this reader warns or refuses instead. The keys are
walked by ``zerobridge.translate.keys.SourceKeys`` with DeepSpeed's options
(JSON booleans, near-miss top-level keys refused, aliases named); this module
says what each setting means. The writer is ``zerobridge.translate.deepspeed_write``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from zerobridge.spec import AUTO, DType, EveryModuleWrap, GradSync, RootWrap, ShardingSpec, StrategySpec, is_auto
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.spec.stage import Stage
from zerobridge.translate.compilation import read_deepspeed_compile
from zerobridge.translate.compute_copy import note_layout
from zerobridge.translate.deepspeed_buckets import UNBOUNDED
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located
from zerobridge.translate.values import as_dtype
from zerobridge.translate.wire import read_deepspeed_wire

__all__ = ["read_deepspeed"]

FORMAT = "deepspeed"
_SIZES = {"fp32": DType.FP32, "fp16": DType.FP16, "bf16": DType.BF16}


def read_deepspeed(located: Located) -> Translation[StrategySpec]:
    """The spec a DeepSpeed config means, and a key-by-key report."""
    report = Report(source=FORMAT, target="spec")
    data = dict(located.data)
    legacy_zero = data.get("zero_optimization")
    if isinstance(legacy_zero, bool):
        data["zero_optimization"] = {"stage": 1 if legacy_zero else 0}
        report.add("zero_optimization", Status.EXACT,
                   f"deprecated boolean form: {legacy_zero} means stage {1 if legacy_zero else 0}")
    if "bfloat16" in data and "bf16" in data:
        raise located.error("both 'bf16' and its deprecated alias 'bfloat16' are given", key="bfloat16",
                            fix="keep only 'bf16'")
    if "bfloat16" in data:
        data["bf16"] = data.pop("bfloat16")
        report.add("bfloat16", Status.EXACT, "deprecated section name, read as bf16")
    keys = SourceKeys(Located(data, located.source, located.text, located.lines), load_table(FORMAT), report,
                      consumer="DeepSpeed", top_level_typos="error", filled_by="HF Trainer or Accelerate",
                      name_aliases=True, carried_note="carried verbatim", null_is_empty=False)
    stage = Stage(_stage(keys))
    fields: dict[str, Any] = {
        "sharding": _sharding(keys, stage),
        "offload": _offload(keys, stage),
        "precision": _precision(keys),
        "communication": _communication(keys, stage),
        "wrapping": _wrapping(keys, stage),
        "batch": _batch(keys, stage),
        "checkpoint": _checkpoint(keys),
        "compile": read_deepspeed_compile(keys),
    }
    if keys.carried:
        fields["passthrough"] = {FORMAT: keys.carried}
    try:
        spec = StrategySpec.model_validate(fields)
    except ValidationError as exc:
        raise keys.spec_error(exc) from None
    return Translation(spec, report)


def _stage(keys: SourceKeys) -> int:
    stage = keys.get("zero_optimization.stage")
    if stage not in (0, 1, 2, 3):
        raise keys.located.error(f"expected a ZeRO stage 0, 1, 2 or 3, got {stage!r}",
                                 key="zero_optimization.stage")
    keys.note("zero_optimization.stage")
    if keys.get("zero_optimization.legacy_stage1"):
        raise keys.located.error("legacy_stage1 was removed in DeepSpeed 0.5.9; DeepSpeed raises on it",
                                 key="zero_optimization.legacy_stage1", fix="delete the key")
    keys.note("zero_optimization.legacy_stage1")
    return int(stage)


def _sharding(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    fields: dict[str, Any] = dict(ShardingSpec.for_stage(stage).model_dump())
    # Both group sizes are stage-3 features that DeepSpeed ignores below it;
    # each is off at its own "unset" value (-1 for MiCS, 1 for hpZ).
    for path, field, feature, off in (("zero_optimization.mics_shard_size", "shard_group", "MiCS", 0),
                                      ("zero_optimization.zero_hpz_partition_size", "backward_gather_group",
                                       "hpZ", 1)):
        size = keys.get(path)
        if size is not None and size > off:
            if stage is not Stage.PARAMETERS:
                keys.note(path, Status.IGNORED, f"DeepSpeed uses {feature} only at stage 3; ignored at stage "
                                                f"{stage.value}")
            else:
                fields[field] = size
                keys.note(path)
        elif keys.given(path):
            keys.note(path, Status.EXACT, "off")
    return fields


def _offload(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    legacy_pin = keys.get("zero_optimization.cpu_offload_use_pin_memory")
    tiers: dict[str, dict[str, Any]] = {}
    for tier, section, legacy in (("optimizer", "offload_optimizer", "cpu_offload"),
                                  ("parameters", "offload_param", "cpu_offload_param")):
        prefix = f"zero_optimization.{section}"
        rows = [r for r in keys.table.rows if r.path.startswith(prefix + ".")]
        fields: dict[str, Any] = {}
        for row in rows:
            if keys.given(row.path) or row.has_default:
                fields[row.spec.rsplit(".", 1)[1]] = keys.get(row.path)
        legacy_on = keys.get(f"zero_optimization.{legacy}")
        if keys.given(f"zero_optimization.{legacy}"):
            if keys.given(f"{prefix}.device"):
                raise keys.located.error(f"deprecated {legacy!r} given together with its replacement "
                                         f"{section}.device", key=f"zero_optimization.{legacy}",
                                         fix=f"delete {legacy!r}")
            fields["device"] = "cpu" if legacy_on else "none"
            keys.note(f"zero_optimization.{legacy}")
        if legacy_pin is not None and not keys.given(f"{prefix}.pin_memory"):
            fields["pin_memory"] = legacy_pin
        if fields.get("device") != "nvme" and fields.get("nvme_path") not in (None, ""):
            keys.note(f"{prefix}.nvme_path", Status.IGNORED, "device is not nvme, so the path is unused")
            fields["nvme_path"] = None
        for row in rows:
            if row.path != f"{prefix}.nvme_path" or keys.report.find(row.path) is None:
                keys.note(row.path)
        tiers[tier] = fields
    if keys.given("zero_optimization.cpu_offload_use_pin_memory"):
        keys.note("zero_optimization.cpu_offload_use_pin_memory")
    param_device = tiers["parameters"].get("device", "none")
    if param_device != "none" and stage is not Stage.PARAMETERS:
        path = "zero_optimization.offload_param.device"  # absent when the legacy key set it: reported as the default
        keys.note(path, Status.IGNORED if keys.given(path) else None,
                  f"DeepSpeed ignores parameter offload at stage {stage.value}: parameters stay in memory")
        tiers["parameters"] = {"device": "none"}
    opt_device = tiers["optimizer"].get("device", "none")
    if opt_device != "none" and stage is Stage.NONE:
        path = "zero_optimization.offload_optimizer.device"
        keys.note(path, Status.IGNORED if keys.given(path) else None,
                  "DeepSpeed offloads optimizer state only with ZeRO (stage 1 or higher)")
        tiers["optimizer"] = {"device": "none"}
    size = keys.get("zero_optimization.sub_group_size")
    keys.note("zero_optimization.sub_group_size")
    return {**tiers, "sub_group_size": size}


def _dtype_key(keys: SourceKeys, path: str) -> DType | None:
    value = keys.get(path)
    if value is None:
        return None
    keys.note(path)
    return _SIZES[value] if value in _SIZES else as_dtype(keys.located, keys.key(path), value)


def _precision(keys: SourceKeys) -> dict[str, Any]:
    fp16, bf16 = keys.get("fp16.enabled"), keys.get("bf16.enabled")
    keys.note("fp16.enabled")
    keys.note("bf16.enabled")
    if fp16 is True and bf16 is True:
        raise keys.located.error("fp16.enabled and bf16.enabled are both true", key="bf16.enabled",
                                 fix="enable one of them (DeepSpeed refuses both)")
    compute: Any
    if fp16 is True:
        compute = DType.FP16
    elif bf16 is True:
        compute = DType.BF16
    elif AUTO in (fp16, bf16):
        compute = AUTO
    else:
        compute = DType.FP32
    declared = _dtype_key(keys, "data_types.param_dtype")
    if declared is not None and compute is not AUTO and declared is not compute:
        raise keys.located.error(f"data_types.param_dtype={declared.value} but the fp16/bf16 sections make "
                                 f"the model {compute}", key="data_types.param_dtype",
                                 fix="make them agree (DeepSpeed asserts it)")
    master = DType.FP32
    for flag, dtype in (("fp16.fp16_master_weights_and_grads", DType.FP16),
                        ("bf16.bf16_master_weights_and_grads", DType.BF16)):
        if keys.get(flag) is True and compute == dtype:
            master = dtype
        keys.note(flag)
    reduce = _dtype_key(keys, "communication_data_type") or compute
    if not keys.given("communication_data_type"):
        keys.report.add("communication_data_type", Status.DEFAULT,
                        f"absent: DeepSpeed reduces in the compute dtype ({compute})", target="precision.reduce_dtype")
    accumulate = _dtype_key(keys, "data_types.grad_accum_dtype") or compute
    buffer = _dtype_key(keys, "data_types.buffer_dtype")
    fields: dict[str, Any] = {"param_dtype": compute, "master_dtype": master if compute is not AUTO else DType.FP32,
                              "auto_choices": tuple(d for flag, d in ((bf16, DType.BF16), (fp16, DType.FP16))
                                                    if flag == AUTO),
                              "reduce_dtype": reduce, "accumulate_dtype": accumulate, "buffer_dtype": buffer,
                              "loss_scaling": _loss_scaling(keys, compute)}
    if (compute is AUTO or compute != DType.FP32) and master == DType.FP32:
        fields["compute_copy"] = note_layout(keys.report, "deepspeed", key="fp16.enabled" if fp16 in (True, AUTO)
                                             and bf16 is not True else "bf16.enabled")
    if compute == DType.FP16:
        fields["skip_nonfinite_steps"] = True
    elif compute == DType.BF16 or compute is AUTO:
        fields["skip_nonfinite_steps"] = bool(keys.get("bf16.check_grad_overflow"))
        keys.note("bf16.check_grad_overflow")
    for path in list(keys.values):
        if keys.table.row(path).status is Status.IGNORED and path.startswith("bf16."):
            keys.note(path)
    return fields


def _loss_scaling(keys: SourceKeys, compute: Any) -> Any:
    paths = ("fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
             "fp16.consecutive_hysteresis", "fp16.min_loss_scale")
    if compute is not DType.FP16 and keys.get("fp16.enabled") != AUTO:  # fp16 can never be switched on
        for path in paths:
            if keys.given(path):
                keys.note(path, Status.EXACT, "unused: fp16 is not enabled, so there is no loss scaling")
        return {"kind": "none"}
    for path in paths:
        keys.note(path)
    static = keys.get("fp16.loss_scale")
    if static and static > 0:
        return {"kind": "static", "scale": static}
    return {
        "kind": "dynamic",
        "initial_scale": 2.0 ** keys.get("fp16.initial_scale_power"),
        "growth_interval": keys.get("fp16.loss_scale_window"),
        "hysteresis": keys.get("fp16.hysteresis"),
        "consecutive_hysteresis": keys.get("fp16.consecutive_hysteresis"),
        "min_scale": keys.get("fp16.min_loss_scale"),
    }


def _communication(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for path in ("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
                 "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
                 "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold",
                 "zero_optimization.stage3_model_persistence_threshold"):
        value = keys.get(path)
        if isinstance(value, int) and value < 0:
            raise keys.located.error(f"must be >= 0, got {value}", key=keys.key(path))
        if value is not None:
            fields[keys.table.row(path).spec.split(".")[1]] = value
        keys.note(path)
    if "model_persistence_threshold" in fields and fields["model_persistence_threshold"] >= UNBOUNDED:
        fields["model_persistence_threshold"] = None
    if keys.given("zero_optimization.stage3_param_persitence_threshold"):
        keys.report.add(keys.key("zero_optimization.stage3_param_persitence_threshold"), Status.IGNORED,
                        keys.table.row("zero_optimization.stage3_param_persitence_threshold").note)
    overlap = keys.get("zero_optimization.overlap_comm")
    if overlap is None:
        overlap = stage is Stage.PARAMETERS
        keys.report.add("zero_optimization.overlap_comm", Status.DEFAULT,
                        f"absent: DeepSpeed overlaps only at stage 3, so {str(overlap).lower()} here",
                        target="communication.overlap_reduce")
    else:
        keys.note("zero_optimization.overlap_comm")
    fields["overlap_reduce"] = overlap
    # Stage 3 prefetches along the recorded execution order, forward and
    # backward alike, unless the prefetch bucket is 0.
    prefetching = stage is Stage.PARAMETERS and fields.get("prefetch_bucket") != 0
    fields["forward_prefetch"] = prefetching
    fields["backward_prefetch"] = "before_grad" if prefetching or stage is not Stage.PARAMETERS else "none"
    wire = read_deepspeed_wire(keys, stage)
    if wire:
        fields["wire"] = wire
    return fields


def _wrapping(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    leaf = keys.get("zero_optimization.leaf_module")
    classes: tuple[str, ...] = ()
    if leaf is not None:
        if not isinstance(leaf, dict):
            raise keys.located.error("expected {classes: [...], names: [...], name_suffixes: [...]}",
                                     key="zero_optimization.leaf_module")
        classes = tuple(str(c) for c in leaf.get("classes", ()))
        keys.note("zero_optimization.leaf_module", None if stage is Stage.PARAMETERS else Status.EXACT,
                  "" if stage is Stage.PARAMETERS else "unused below stage 3")
    if stage is not Stage.PARAMETERS:
        # Below stage 3 every rank holds the whole model at all times: one
        # unit, the root, is what that means in FSDP terms.
        return RootWrap().model_dump()
    return EveryModuleWrap(leaf_classes=classes).model_dump()


def _batch(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    micro = keys.get("train_micro_batch_size_per_gpu")
    accumulation = keys.get("gradient_accumulation_steps")
    global_batch = keys.get("train_batch_size")
    for path, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accumulation),
                        ("train_batch_size", global_batch)):
        if isinstance(value, int) and value < 1:
            raise keys.located.error(f"must be a positive integer, got {value}", key=path)
        keys.note(path)
    if accumulation is None:
        derivable = isinstance(micro, int) and isinstance(global_batch, int)
        keys.report.add("gradient_accumulation_steps", Status.DEFAULT,
                        "absent: DeepSpeed derives it from train_batch_size / (micro x world)" if derivable
                        else "absent: 1", target="batch.accumulation_steps")
        accumulation = None if derivable else 1
    clip = keys.get("gradient_clipping")
    if keys.given("gradient_clipping"):
        keys.note("gradient_clipping")
    else:
        keys.report.add("gradient_clipping", Status.DEFAULT,
                        "absent: DeepSpeed clips at 1.0 by default since 0.19.3; written explicitly",
                        target="batch.clip_grad_norm")
    if isinstance(clip, float) and clip < 0:
        raise keys.located.error(f"must be >= 0, got {clip}", key="gradient_clipping")
    sync = GradSync.ACCUMULATION_BOUNDARY if stage <= Stage.OPTIMIZER else GradSync.EVERY_MICRO_STEP
    return {"micro_batch_size": micro, "accumulation_steps": accumulation, "global_batch_size": global_batch,
            "clip_grad_norm": None if clip == 0 else clip, "grad_sync": sync}


def _checkpoint(keys: SourceKeys) -> dict[str, Any]:
    new, old = ("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                "zero_optimization.stage3_gather_fp16_weights_on_model_save")
    if keys.given(new) and keys.given(old):
        raise keys.located.error(f"deprecated {old.split('.')[1]!r} given together with its replacement",
                                 key=old, fix=f"keep only {new.split('.')[1]!r}")
    gather = keys.get(old) if keys.given(old) else keys.get(new)
    keys.note(old if keys.given(old) else new)
    if is_auto(gather):
        return {"format": AUTO}
    return {"format": CheckpointFormat.CONSOLIDATED_16BIT if gather else CheckpointFormat.SHARDED}

