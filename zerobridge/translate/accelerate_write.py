"""Spec -> HF Accelerate config YAML, checked by reading the YAML back.

    >>> from zerobridge.spec import StrategySpec, ShardingSpec
    >>> from zerobridge.translate.accelerate_write import write_accelerate_deepspeed, write_accelerate_fsdp
    >>> spec = StrategySpec(sharding=ShardingSpec.for_stage(3))
    >>> t = write_accelerate_fsdp(spec)
    >>> t.value["distributed_type"], t.value["fsdp_config"]["fsdp_reshard_after_forward"]
    ('FSDP', True)
    >>> write_accelerate_deepspeed(spec).value["deepspeed_config"]["zero_stage"]
    3

Each writer emits the YAML as a dict (``formats`` dumps it), reads it back with
``read_accelerate`` and reports every spec field the YAML cannot carry, with a
hint at the code-side setting that does.
"""

from __future__ import annotations

from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, SizeWrap, StrategySpec, WireFormat, is_auto
from zerobridge.translate.accelerate_common import FORMAT, D, F
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.carried import report_carried
from zerobridge.translate.compilation import write_dynamo
from zerobridge.translate.compute_copy import write_compute_copy
from zerobridge.translate.keys import join_notes, spec_diff
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located

__all__ = ["write_accelerate_deepspeed", "write_accelerate_fsdp"]

_DS_HINT = "the inline deepspeed_config cannot carry it: use a deepspeed_config_file made with " \
    "`zerobridge convert --to deepspeed`"
_HINTS = {
    "batch.accumulation_steps": "pass Accelerator(gradient_accumulation_steps=...) in code",
    "batch.clip_grad_norm": "call accelerator.clip_grad_norm_(model.parameters(), max_norm) in the loop",
    "batch.grad_sync": "Accelerate skips gradient sync between accumulation boundaries unless "
                       "GradientAccumulationPlugin(sync_each_batch=True) is passed in code",
    "batch.": "set by the training script, not the config",
    "precision.loss_scaling": "pass kwargs_handlers=[GradScalerKwargs(...)] to Accelerator in code; torch's scaler "
                              "has no hysteresis and no minimum scale",
    "precision.buffer_dtype": "FSDP2 has no buffer dtype: buffers keep the dtype they were created in",
    "precision.skip_nonfinite_steps": "FSDP steps on inf/nan gradients; in the loop, skip optimizer.step() when "
                                      "the norm accelerator.clip_grad_norm_ returns is not finite",
    "precision.": "pass FullyShardedDataParallelPlugin(mixed_precision_policy=...) in code",
    "communication.max_inflight_gathers": "FSDP1's limit_all_gathers (always on through Accelerate) has no FSDP2 form",
    "communication.": "FSDP communicates once per wrap unit",
}
_PREFETCH_NAMES = {"before_grad": "BACKWARD_PRE", "after_grad": "BACKWARD_POST", "none": "NO_PREFETCH"}


def write_accelerate_fsdp(spec: StrategySpec, *, fsdp_version: int = 2) -> Translation[dict[str, Any]]:
    """An Accelerate FSDP config (a dict that dumps to the YAML) for ``spec``."""
    if fsdp_version not in (1, 2):
        raise ConfigError(f"fsdp_version must be 1 or 2, got {fsdp_version!r}")
    report = Report(source="spec", target="accelerate-fsdp" if fsdp_version == 2 else "accelerate-fsdp1")
    out, sections = _base(spec, report)
    s, w, o = spec.sharding, spec.wrapping, spec.offload
    if s.stage == 0 and fsdp_version == 2:
        out["distributed_type"] = "MULTI_GPU"
        report.add("sharding", Status.EQUIVALENT, "stage 0 is plain data parallelism: Accelerate's MULTI_GPU (DDP); "
                   "FSDP2 has no unsharded mode", target="distributed_type")
        return _checked(spec, out, report, "")
    out["distributed_type"] = "FSDP"
    fsdp: dict[str, Any] = {**sections.get("fsdp_config", {}), "fsdp_version": fsdp_version}
    after_forward = s.parameters.value == "reshard_after_forward"
    if s.stage in (1, 2):
        report.add("sharding", Status.APPROXIMATED, f"ZeRO-{s.stage.value} keeps parameters whole between "
                   "steps; the nearest FSDP form (SHARD_GRAD_OP) shards them at rest and gathers them once per step"
                   + ("" if s.stage == 2 else ", and shards gradients too"), target=F + "fsdp_reshard_after_forward")
    if s.backward_gather_group is not None:
        report.add("sharding.backward_gather_group", Status.NOT_EXPRESSIBLE, "Accelerate takes only a boolean "
                   "reshard_after_forward: backward gathers from the whole shard group (no hpZ)")
    groups = (s.world_size // s.shard_group, s.shard_group) if isinstance(s.shard_group, int) and s.world_size \
        else None
    if s.is_hybrid and groups is None:
        report.add("sharding.shard_group", Status.NOT_EXPRESSIBLE, f"shard group {s.shard_group!r} needs a known "
                   "world size and an integer group to become Accelerate's hybrid sizes")
    hybrid = s.is_hybrid and groups is not None
    wrap_policy = w.policy
    if fsdp_version == 1:
        name = "NO_SHARD" if s.stage == 0 else \
            ("HYBRID_SHARD" if after_forward else "HYBRID_SHARD_ZERO2") if hybrid else \
            ("FULL_SHARD" if after_forward else "SHARD_GRAD_OP")
        fsdp["fsdp_sharding_strategy"] = fsdp["fsdp_reshard_after_forward"] = name
        if hybrid and groups:
            out["num_machines"] = groups[0]
            report.add("sharding.shard_group", Status.EQUIVALENT, f"FSDP1 through Accelerate shards inside each "
                       f"machine: {groups[0]} machines of {groups[1]} processes", target="num_machines")
            if wrap_policy == "root":
                wrap_policy = "every_module"
                report.add("wrapping", Status.APPROXIMATED, "FSDP1 refuses hybrid sharding without an auto-wrap "
                           "policy here: one unit per transformer layer", target=F + "fsdp_auto_wrap_policy")
        fsdp["fsdp_backward_prefetch"] = _PREFETCH_NAMES[spec.communication.backward_prefetch.value]
        fsdp["fsdp_forward_prefetch"] = spec.communication.forward_prefetch
    else:
        fsdp["fsdp_reshard_after_forward"] = after_forward
        if hybrid and groups:
            out["parallelism_config"] = {**sections.get("parallelism_config", {}),
                                         "parallelism_config_dp_replicate_size": groups[0],
                                         "parallelism_config_dp_shard_size": groups[1]}
    fsdp["fsdp_offload_params"] = o.optimizer.enabled or o.parameters.enabled
    if fsdp["fsdp_offload_params"] and not (o.optimizer.device.value == o.parameters.device.value == "cpu"):
        report.add("offload", Status.APPROXIMATED, "FSDP moves parameters, gradients and the optimizer step to host "
                   "memory together: no optimizer-only and no NVMe tier", target=F + "fsdp_offload_params")
    if wrap_policy in ("transformer", "every_module"):
        fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        classes = getattr(w, "layer_classes", "auto")
        if not is_auto(classes):
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
        if w.policy == "every_module" and wrap_policy == w.policy:
            report.add("wrapping", Status.APPROXIMATED, "ZeRO-3 fetches every module on its own; the nearest FSDP "
                       "unit is one per transformer layer (_no_split_modules)", target=F + "fsdp_auto_wrap_policy")
    elif isinstance(w, SizeWrap):  # the policy is "size" exactly when the spec's is
        fsdp["fsdp_auto_wrap_policy"], fsdp["fsdp_min_num_params"] = "SIZE_BASED_WRAP", w.min_params
    else:
        fsdp["fsdp_auto_wrap_policy"] = "NO_WRAP"
    fmt = spec.checkpoint.format
    if not is_auto(fmt):
        fsdp["fsdp_state_dict_type"] = "SHARDED_STATE_DICT" if fmt == "sharded" else "FULL_STATE_DICT"
        if fmt == "consolidated_16bit":
            report.add("checkpoint.format", Status.APPROXIMATED, "FULL_STATE_DICT: one fp32 dict gathered on rank 0 "
                       "instead of shards plus a 16-bit copy", target=F + "fsdp_state_dict_type")
    fsdp["fsdp_activation_checkpointing"] = spec.checkpoint.activation_checkpointing
    out["fsdp_config"] = fsdp
    if spec.communication.wire.param_gather is WireFormat.FP8 and s.parameters.sharded_at_rest \
            and out.get("mixed_precision") == "bf16":
        out["mixed_precision"] = "fp8"
        out["fp8_config"] = {"backend": "AO", **out.get("fp8_config", {}), "enable_fsdp_float8_all_gather": True}
        report.add("communication.wire.param_gather", Status.APPROXIMATED, "fp8: Accelerate gathers float8 weights "
                   "only under mixed_precision fp8, which also runs the linear layers' matmuls in fp8 (torchao)",
                   target="fp8_config.enable_fsdp_float8_all_gather")
    return _checked(spec, out, report, "")


def write_accelerate_deepspeed(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """An Accelerate DeepSpeed config with inline deepspeed_config keys for ``spec``; what the inline
    keys cannot carry is reported."""
    report = Report(source="spec", target="accelerate-deepspeed")
    out, sections = _base(spec, report, deepspeed=True)
    out["distributed_type"] = "DEEPSPEED"
    o, b = spec.offload, spec.batch
    ds: dict[str, Any] = {**sections.get("deepspeed_config", {}), "zero_stage": spec.sharding.stage.value,
                          "offload_optimizer_device": o.optimizer.device.value,
                          "offload_param_device": o.parameters.device.value}
    if b.accumulation_steps is not None:
        ds["gradient_accumulation_steps"] = b.accumulation_steps
    for short, tier in (("optimizer", o.optimizer), ("param", o.parameters)):
        if tier.device.value == "nvme":
            ds[f"offload_{short}_nvme_path"] = tier.nvme_path
    if b.clip_grad_norm:
        ds["gradient_clipping"] = b.clip_grad_norm
    else:
        report.add("batch.clip_grad_norm", Status.NOT_EXPRESSIBLE, "no clipping: Accelerate leaves a zero clip out of "
                   f"the JSON, so DeepSpeed clips at 1.0; {_DS_HINT}", target=D + "gradient_clipping")
    if spec.checkpoint.format == "consolidated_16bit":
        ds["zero3_save_16bit_model"] = True
    leaves = getattr(spec.wrapping, "leaf_classes", ())
    if leaves:
        ds["deepspeed_moe_layer_cls_names"] = ",".join(leaves)
    out["deepspeed_config"] = ds
    return _checked(spec, out, report, _DS_HINT)


def _base(spec: StrategySpec, report: Report, *, deepspeed: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Top-level keys: the carried Accelerate settings, mixed_precision, dynamo_config, num_processes."""
    carried = dict(spec.passthrough.get(FORMAT, {}))
    sections = {k: carried.pop(k) for k in ("fsdp_config", "deepspeed_config", "parallelism_config")
                if isinstance(carried.get(k), dict)}
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", **carried}
    p = spec.precision
    if is_auto(p.param_dtype):
        report.add("precision.param_dtype", Status.AUTO, "left to --mixed_precision on the command line",
                   target="mixed_precision")
    else:
        out["mixed_precision"] = "no" if p.param_dtype == DType.FP32 else DType(p.param_dtype).value
        if p.param_dtype != DType.FP32 and p.master_dtype != DType.FP32:
            report.add("precision.master_dtype", Status.APPROXIMATED, "Accelerate keeps fp32 master weights under "
                       f"mixed precision; pure {p.param_dtype} training is mixed_precision: no with the model loaded "
                       f"in {p.param_dtype}", target="mixed_precision")
    write_compute_copy(report, p, "deepspeed" if deepspeed else "fsdp", target="mixed_precision")
    dynamo = write_dynamo(spec, report, deepspeed=deepspeed)
    if dynamo is not None:
        out["dynamo_config"] = dynamo
    if spec.sharding.world_size:
        out["num_processes"] = spec.sharding.world_size
    elif "num_processes" not in out:
        report.add("sharding.world_size", Status.AUTO, "num_processes not written (the source does not fix the "
                   "world size): pass --world-size N to zerobridge convert, or --num_processes N to accelerate "
                   "launch, which refuses this file without one", target="num_processes")
    return out, sections


def _checked(spec: StrategySpec, out: dict[str, Any], report: Report, hint: str) -> Translation[dict[str, Any]]:
    """Read the written config back and report every spec field it does not reproduce."""
    back = read_accelerate(Located(out, "<written accelerate config>")).value
    done = [e.key for e in report.entries]
    for path, want, got in spec_diff(spec, back):
        if path == "name":  # the spec's label (a registry name), not a setting: nothing to carry
            continue
        if not any(path == k or path.startswith(k + ".") for k in done):
            extra = hint or next((h for p, h in _HINTS.items() if path.startswith(p)), "")
            report.add(path, _status(spec, path, want), join_notes(f"{want!r} has no form here; the config gives "
                                                                   f"{got!r}", extra))
    report_carried(spec, report, own=FORMAT, target="an Accelerate config", trainer=True, elsewhere=hint)
    return Translation(out, report)


def _status(spec: StrategySpec, path: str, want: Any) -> Status:
    """How a spec field the written config does not reproduce is reported."""
    if is_auto(want) or (path.startswith("precision.") and is_auto(spec.precision.param_dtype)):
        # Filled at run time from the same arguments in both flavors (Trainer's --bf16/--fp16,
        # batch and accumulation flags); a precision detail matters only once one is picked.
        return Status.AUTO
    if path == "batch.grad_sync":
        return Status.EQUIVALENT  # the same gradients: only traffic and memory under accumulation differ
    return Status.NOT_EXPRESSIBLE
