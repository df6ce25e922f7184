"""Spec -> FSDP1 and FSDP2 JSON: the writing helpers both FSDP writers share.

    >>> from zerobridge.spec import StrategySpec, ShardingSpec
    >>> from zerobridge.translate.report import Report
    >>> from zerobridge.translate.fsdp_write import stage_plan
    >>> stage_plan(StrategySpec(sharding=ShardingSpec.for_stage(1)), Report(source="spec", target="fsdp2"),
    ...            target="reshard_after_forward")
    StagePlan(sharded=True, reshard_after_forward=False, force_no_sync=True)

``write_fsdp1`` (``fsdp1.py``) and ``write_fsdp2`` (``fsdp2.py``) build their
forms from these: the stage plan (ZeRO-1 and ZeRO-2 approximated), meshes,
offload, precision with ``auto`` resolved (raw FSDP has no launcher to fill
it), the ``training_loop`` section, the wrap policy, the checkpoint format,
and a report of the DeepSpeed-only settings FSDP fixes. What the readers share
is in ``fsdp_common.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerobridge.spec import (
    AUTO,
    CheckpointFormat,
    DType,
    DynamicLossScale,
    EveryModuleWrap,
    GradSync,
    OffloadDevice,
    ParamSharding,
    RootWrap,
    SizeWrap,
    Stage,
    StaticLossScale,
    StrategySpec,
    TransformerWrap,
    is_auto,
)
from zerobridge.translate.compute_copy import write_compute_copy
from zerobridge.translate.fsdp_common import DIM_NAMES, PER_UNIT, shown
from zerobridge.translate.report import Report, Status
from zerobridge.translate.values import name_in_torch

__all__ = [
    "StagePlan", "checkpoint_format", "mesh_form", "report_fixed_behaviour", "resolve_precision", "stage_plan",
    "write_offload", "write_training_loop", "write_wrap",
]


class StagePlan(NamedTuple):
    """How a spec's sharding is written for FSDP."""

    sharded: bool
    """False: nothing sharded (NO_SHARD / replicate-only)."""
    reshard_after_forward: bool
    force_no_sync: bool
    """ZeRO-1: gradients reduced once per optimizer step."""


def stage_plan(spec: StrategySpec, report: Report, *, target: str) -> StagePlan:
    """The FSDP form of the spec's stage; ZeRO-1 and ZeRO-2 are approximated."""
    s = spec.sharding
    if s.stage is not Stage.NONE and s.shard_group == 1:
        report.add("sharding.shard_group", Status.EQUIVALENT, "shard groups of one rank shard nothing: written as "
                   "stage 0", target=target)
    if s.stage is Stage.NONE or s.shard_group == 1:
        return StagePlan(False, False, False)
    if s.stage is Stage.OPTIMIZER:
        report.add("sharding", Status.APPROXIMATED, "ZeRO-1 has no FSDP form: written as parameters resharded "
                   "after backward with gradient sync only at the accumulation boundary; unlike ZeRO-1 this also "
                   "shards gradients and parameters between steps", target=target)
        return StagePlan(True, False, True)
    if s.stage is Stage.GRADIENTS:
        report.add("sharding", Status.APPROXIMATED, "ZeRO-2 keeps full parameters on every rank; FSDP shards "
                   "parameters at rest and gathers them once per step for forward and backward (same gradient "
                   "and optimizer sharding, similar traffic, less memory)", target=target)
        return StagePlan(True, False, False)
    raf = s.parameters is ParamSharding.RESHARD_AFTER_FORWARD
    report.add("sharding", Status.EXACT, "parameters freed after forward and gathered again for backward" if raf
               else "parameters gathered once per step and kept until the end of backward", target=target)
    return StagePlan(True, raf, False)


def mesh_form(shape: list[int], spec: StrategySpec, fmt: str, names_key: str) -> dict[str, Any]:
    """``{"shape", "mesh_dim_names"}``, with carried names when they fit."""
    names = spec.passthrough.get(fmt, {}).get(names_key)
    if isinstance(names, list) and len(names) == len(shape):
        return {"shape": shape, "mesh_dim_names": list(names)}
    return {"shape": shape, "mesh_dim_names": list(DIM_NAMES[len(shape)])}


def write_offload(spec: StrategySpec, report: Report, plan: StagePlan, *, target: str) -> tuple[bool, bool]:
    """(offload on, pin_memory): FSDP moves parameters, gradients and the
    optimizer step to host memory together, never to NVMe."""
    opt, par = spec.offload.optimizer, spec.offload.parameters
    if not plan.sharded:
        if opt.enabled or par.enabled:
            report.add("offload", Status.NOT_EXPRESSIBLE, "nothing is sharded, and the spec offloads only sharded "
                       "states: no offload written", target=target)
        return False, True
    # FSDP has no NVMe tier; its nearest runnable form is host memory (Accelerate maps every
    # DeepSpeed offload device to fsdp_offload_params: true), reported as approximated below.
    on_opt, on_par = opt.enabled, par.enabled
    if on_par and on_opt:
        report.add("offload", Status.EXACT, "parameters, gradients and the optimizer step in host memory",
                   target=target)
    elif on_par:
        report.add("offload.parameters.device", Status.APPROXIMATED, "FSDP cannot offload parameters alone: "
                   "gradients and the optimizer step move to host memory as well", target=target)
    elif on_opt:
        report.add("offload.optimizer.device", Status.NOT_EXPRESSIBLE, "FSDP cannot offload optimizer state "
                   "alone (its offload moves parameters too); no offload written", target=target)
    if on_par:
        for name, tier in (("optimizer", opt), ("parameters", par)):
            if tier.device is OffloadDevice.NVME:
                report.add(f"offload.{name}.device", Status.APPROXIMATED, "nvme -> cpu: FSDP has no NVMe tier, "
                           "so this offloads to host memory, its nearest runnable form (needs host RAM for the "
                           "offloaded states)", target=target)
    if on_par and on_opt and opt.ratio < 1.0:
        report.add("offload.optimizer.ratio", Status.APPROXIMATED,
                   f"FSDP offloads the whole optimizer step, not a fraction of {opt.ratio}", target=target)
    return on_par, par.pin_memory and (opt.pin_memory or not on_opt)


def resolve_precision(spec: StrategySpec, report: Report, *, target: str) -> tuple[DType, DType, DType]:
    """(param, reduce, master) with ``auto`` resolved: raw FSDP has no launcher to fill it."""
    p = spec.precision
    master = p.master_dtype
    param = master if is_auto(p.param_dtype) else DType(p.param_dtype)
    reduce = param if is_auto(p.reduce_dtype) else DType(p.reduce_dtype)
    for name, value in (("param_dtype", param), ("reduce_dtype", reduce)):
        if is_auto(getattr(p, name)):
            report.add(f"precision.{name}", Status.APPROXIMATED, f"\"auto\" has no launcher to fill it under raw "
                       f"FSDP: written as {name_in_torch(value)}", target=target)
    if not is_auto(p.param_dtype):
        write_compute_copy(report, p, "fsdp", target=target)
    return param, reduce, master


def write_training_loop(spec: StrategySpec, report: Report, *, param: DType, force_no_sync: bool,
                        clip_api: str) -> dict[str, Any]:
    """The ``training_loop`` section for ``spec``; ``auto`` values resolved and reported."""
    b, p = spec.batch, spec.precision
    out: dict[str, Any] = {}

    def noted(field: str, key: str, value: Any, text: str, status: Status = Status.APPROXIMATED) -> Any:
        report.add(field, status, text, target=f"training_loop.{key}")
        return value

    def left(field: str, key: str) -> None:
        report.add(field, Status.AUTO, "\"auto\": not written, left to the training script (HF Trainer fills it "
                   "from TrainingArguments in both flavors)", target=f"training_loop.{key}")

    clip = b.clip_grad_norm
    if is_auto(clip):
        left("batch.clip_grad_norm", "clip_grad_norm")
    elif clip == 0:
        out["clip_grad_norm"] = noted("batch.clip_grad_norm", "clip_grad_norm", None,
                                      "0 means no clipping: written as null", Status.EQUIVALENT)
    else:
        if clip is not None:
            noted("batch.clip_grad_norm", "clip_grad_norm", clip, f"the loop calls {clip_api}(max_norm={clip})",
                  Status.EXACT)
        out["clip_grad_norm"] = clip
    steps = b.accumulation_steps
    if is_auto(steps):
        left("batch.accumulation_steps", "gradient_accumulation_steps")
    else:
        if steps is None:
            noted("batch.accumulation_steps", "gradient_accumulation_steps", None, "null: the loop derives it as "
                  "global_batch_size / (micro_batch_size x data-parallel size)", Status.EXACT)
        out["gradient_accumulation_steps"] = steps
    if force_no_sync and b.grad_sync is GradSync.EVERY_MICRO_STEP:
        noted("batch.grad_sync", "grad_sync", None, "ZeRO-1 reduces gradients once per optimizer step: written as "
              "no_sync")
    no_sync = force_no_sync or b.grad_sync is GradSync.ACCUMULATION_BOUNDARY
    out["grad_sync"] = "no_sync" if no_sync else "every_micro_step"
    for name in ("micro_batch_size", "global_batch_size"):
        value = getattr(b, name)
        out[name] = noted(f"batch.{name}", name, None, "\"auto\": written as null, chosen by the data loader",
                          Status.AUTO) if is_auto(value) else value
    out["activation_checkpointing"] = spec.checkpoint.activation_checkpointing
    out["master_dtype"] = name_in_torch(p.master_dtype)
    out["loss_scaler"] = _write_loss_scaler(spec, report, param=param)
    out["skip_nonfinite_steps"] = p.skip_nonfinite_steps
    if out["loss_scaler"] is not None and not p.skip_nonfinite_steps:
        out["skip_nonfinite_steps"] = noted("precision.skip_nonfinite_steps", "skip_nonfinite_steps", True,
                                            "torch's scaler always skips steps whose gradients are not finite")
    return out


def _write_loss_scaler(spec: StrategySpec, report: Report, *, param: DType) -> dict[str, Any] | None:
    loss, target = spec.precision.loss_scaling, "training_loop.loss_scaler"
    if loss.kind == "none":
        return None
    if param is not DType.FP16:
        report.add("precision.loss_scaling", Status.NOT_EXPRESSIBLE, f"compute runs in {name_in_torch(param)}, "
                   "where loss scaling does not apply; no scaler written", target=target)
        return None
    if isinstance(loss, StaticLossScale):
        report.add("precision.loss_scaling", Status.APPROXIMATED, "torch's scaler has no static mode: it starts at "
                   f"{loss.scale}, never grows, but still halves on overflow", target=target)
        return {"init_scale": loss.scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 2**31 - 1}
    assert isinstance(loss, DynamicLossScale)
    differences = []
    if loss.hysteresis != 1 or loss.consecutive_hysteresis:
        differences.append(f"lowers the scale on the first overflow (hysteresis {loss.hysteresis})")
    if loss.min_scale != 0:
        differences.append(f"has no minimum scale ({loss.min_scale})")
    if differences:
        report.add("precision.loss_scaling", Status.APPROXIMATED, "torch's scaler " + " and ".join(differences),
                   target=target)
    else:
        report.add("precision.loss_scaling", Status.EXACT, "dynamic loss scaling", target=target)
    return {"init_scale": loss.initial_scale, "growth_factor": loss.growth_factor,
            "backoff_factor": loss.backoff_factor, "growth_interval": loss.growth_interval}


def write_wrap(spec: StrategySpec, report: Report, *, target: str) -> dict[str, Any] | None:
    """The wrap policy; DeepSpeed's per-module fetch becomes one unit per layer."""
    w = spec.wrapping
    if isinstance(w, RootWrap):
        return None
    if isinstance(w, SizeWrap):
        return {"min_num_params": w.min_params}
    if isinstance(w, TransformerWrap):
        if is_auto(w.layer_classes):
            report.add("wrapping.layer_classes", Status.AUTO, "resolved from the model's _no_split_modules at "
                       "wrap time", target=target)
            return {"transformer_layer_cls": AUTO}
        return {"transformer_layer_cls": list(w.layer_classes)}
    assert isinstance(w, EveryModuleWrap)
    leaves = f"; leaf classes {list(w.leaf_classes)} are gathered whole in their layer" if w.leaf_classes else ""
    report.add("wrapping", Status.APPROXIMATED, "DeepSpeed needs no units (ZeRO-3 fetches each module that owns "
               "parameters on its own); FSDP gathers and reduces whole units. Written as one unit per transformer "
               "layer (\"auto\": the model's _no_split_modules), as Accelerate does: same math, a larger gathered "
               "working set, fewer collectives (a size-based policy can silently leave small layers in the root "
               "unit)" + leaves, target=target)
    return {"transformer_layer_cls": AUTO}


def report_fixed_behaviour(spec: StrategySpec, report: Report) -> None:
    """Report the spec's DeepSpeed-only settings, only where they differ from
    what FSDP does (one collective per unit, always overlapped, no persistence)."""
    c, s = spec.communication, spec.sharding
    at_rest = s.parameters.sharded_at_rest
    why_bucket = "FSDP issues one collective per wrap unit: the wrap policy sets the size"
    checks: list[tuple[str, bool, str]] = [
        ("reduce_bucket", c.reduce_bucket != PER_UNIT, why_bucket),
        ("allgather_bucket", c.allgather_bucket != PER_UNIT and s.optimizer_state and not at_rest, why_bucket),
        ("prefetch_bucket", c.prefetch_bucket != PER_UNIT and at_rest, why_bucket),
        ("overlap_reduce", not c.overlap_reduce, "FSDP always reduces gradients while backward runs"),
        ("persistence_threshold", c.persistence_threshold != 0 and at_rest,
         "FSDP shards every parameter of a unit, however small"),
        ("model_persistence_threshold", c.model_persistence_threshold is not None and at_rest,
         "FSDP keeps no parameters resident outside their unit"),
        ("max_live_parameters", c.max_live_parameters is not None and at_rest,
         "FSDP bounds gathered parameters by its unit size and prefetching, not by an element count"),
        ("max_reuse_distance", c.max_reuse_distance is not None and at_rest,
         "FSDP frees a unit's gathered parameters after each use"),
    ]
    for name, differs, why in checks:
        if differs:
            report.add(f"communication.{name}", Status.NOT_EXPRESSIBLE, f"{shown(getattr(c, name))}: {why}")
    if spec.offload.optimizer.enabled and spec.offload.sub_group_size != 1_000_000_000:
        report.add("offload.sub_group_size", Status.NOT_EXPRESSIBLE, "FSDP steps each rank's whole shard at once")


def checkpoint_format(spec: StrategySpec, report: Report, *, target: str) -> CheckpointFormat:
    """``full`` or ``sharded``; DeepSpeed's 16-bit consolidation and ``auto`` approximated."""
    fmt = spec.checkpoint.format
    if fmt == CheckpointFormat.CONSOLIDATED_16BIT:
        report.add("checkpoint.format", Status.APPROXIMATED, "FSDP's full state dict is in the loaded dtype, not "
                   "a separate 16-bit copy; save optimizer state through optim_state_dict", target=target)
        return CheckpointFormat.FULL
    if is_auto(fmt):
        report.add("checkpoint.format", Status.APPROXIMATED, "\"auto\": written as sharded, Accelerate's choice",
                   target=target)
        return CheckpointFormat.SHARDED
    return CheckpointFormat(fmt)
