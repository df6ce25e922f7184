"""PyTorch FSDP1 and FSDP2 to and from the spec: the entry point, and what the
two translators share (reading values the way torch does, the
``training_loop`` section, wrapping, meshes, the settings FSDP fixes where
DeepSpeed has a knob).

    >>> from zerobridge.spec import StrategySpec, ShardingSpec
    >>> from zerobridge.translate.fsdp import write_fsdp1, write_fsdp2
    >>> zero2 = StrategySpec(sharding=ShardingSpec.for_stage(2))
    >>> write_fsdp1(zero2).value["sharding_strategy"], write_fsdp2(zero2).value["reshard_after_forward"]
    ('SHARD_GRAD_OP', False)
    >>> [e.status.value for e in write_fsdp2(zero2).report if e.key == "sharding"]
    ['approximated']

``read_fsdp1``/``write_fsdp1``/``to_fsdp1_kwargs`` live in ``fsdp1.py``,
``read_fsdp2``/``write_fsdp2``/``to_fsdp2_kwargs``/``fsdp2_units`` in
``fsdp2.py``; both are importable from here. Both JSON forms are FSDP's own
arguments plus a reserved ``training_loop`` section: what the loop around FSDP
must do (clipping, accumulation, loss scaling), so that no run depends on a
silent default. A table row without ``default`` means torch's default is
``None`` (TOML has no null). ``read_keys`` walks a form through its table with
``keys.SourceKeys`` (every section is strict); ``take``, ``choice`` and
``section`` read one value as torch does and record it in the report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import ValidationError

from zerobridge.errors import ConfigError, from_validation_error
from zerobridge.spec import (
    AUTO, BatchSpec, CheckpointFormat, DType, DynamicLossScale, EveryModuleWrap, GradSync,
    LossScaling, NoLossScale, OffloadDevice, ParamSharding, RootWrap, SizeWrap, Stage,
    StaticLossScale, StrategySpec, TransformerWrap, WrapSpec, is_auto,
)
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.mapping import Row, load_table
from zerobridge.translate.report import Report, Status
from zerobridge.translate.sources import Located
from zerobridge.translate.values import as_int, torch_dtype_name

if TYPE_CHECKING:  # torch is imported only by the live-object builders
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

_PUBLIC = {"read_fsdp1": "fsdp1", "write_fsdp1": "fsdp1", "to_fsdp1_kwargs": "fsdp1", "read_fsdp2": "fsdp2",
           "write_fsdp2": "fsdp2", "to_fsdp2_kwargs": "fsdp2", "fsdp2_units": "fsdp2"}


def __getattr__(name: str) -> Any:
    # The translators import this module, so they are re-exported lazily.
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"zerobridge.translate.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_PUBLIC, "DIM_NAMES", "PER_UNIT", "Loop", "StagePlan", "accumulate_dtype_for", "choice",
    "mesh_form", "read_keys", "read_mesh", "read_training_loop", "read_wrap", "report_fixed_behaviour",
    "resolve_precision", "section", "stage_plan", "take", "write_offload", "write_training_loop", "write_wrap",
    "build_mesh", "check_precision", "checkpoint_format", "device_type", "layer_classes", "with_world_size",
]

DIM_NAMES: dict[int, list[str]] = {1: ["dp_shard"], 2: ["dp_replicate", "dp_shard"]}
"""Mesh dimension names zerobridge writes (dim 0 replicates, the last shards)."""
PER_UNIT = "per_unit"
GRAD_SYNC_ALIASES = {"accumulation_boundary": "no_sync", "set_requires_gradient_sync(false)": "no_sync"}


def shown(value: Any) -> str:
    """A value as it is written in the JSON form."""
    return json.dumps(value)


def read_keys(located: Located, fmt: str, report: Report) -> SourceKeys:
    """The keys of one FSDP JSON form, walked through its mapping table (every
    section is strict: an unknown key is an error naming the closest one)."""
    if not isinstance(located.data, dict):
        raise located.error("expected a JSON object at the top", fix="wrap the settings in { ... }")
    return SourceKeys(located, load_table(fmt), report, consumer="torch", locate_unknown=False)


def _fetch(r: SourceKeys, path: str) -> tuple[Row, Any]:
    """The row and the value (torch's default when absent), recorded in the report."""
    row = r.table.row(path)
    if r.given(path):
        r.note(path)
        return row, r.values[path]
    value = row.default if row.has_default else None
    whose = "default" if path.startswith("training_loop") else "torch's default"
    r.report.add(path, Status.DEFAULT, f"not set: {whose} {shown(value)}", target=row.spec)
    return row, value


def section(r: SourceKeys, path: str) -> dict[str, Any] | None:
    """The object at ``path``; ``None`` when it is null or absent."""
    _, value = _fetch(r, path)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise r.error(path, f"expected an object {{...}} or null, got {shown(value)}")
    return value


def take(r: SourceKeys, path: str, *, minimum: float | None = None, nullable: bool = False) -> Any:
    """The coerced value at ``path``, or torch's default when absent."""
    row, value = _fetch(r, path)
    if value is None:
        if r.given(path) and row.has_default and not nullable:
            raise r.error(path, "must not be null", fix=f"remove it for torch's default {shown(row.default)}")
        return None
    if row.type == "str" and not isinstance(value, str):
        raise r.error(path, f"expected a string, got {shown(value)}")
    return r.coerce(row, value, path, minimum=minimum)


def choice(r: SourceKeys, path: str, *, aliases: Mapping[str, str] | None = None,
           nullable: bool = False) -> str | None:
    """One of the row's ``values``, matched case-insensitively (``torch`` enum
    prefixes dropped), or ``None`` where null is allowed."""
    row, value = _fetch(r, path)
    valid = ", ".join(row.values) + (", or null" if nullable else "")
    if value is None:
        if nullable or not row.has_default:
            return None
        raise r.error(path, "must not be null", fix=f"use one of {valid}")
    name = str(value).strip() if not isinstance(value, bool) else ""
    name = name.rsplit(".", 1)[-1] if not name.replace(".", "").isdigit() else name
    by_name = {v.lower(): v for v in row.values} | dict(aliases or {})
    if name.lower() not in by_name:
        raise r.error(path, f"unknown value {shown(value)}", fix=f"use one of {valid}")
    return by_name[name.lower()]


# ----------------------------------------------------------------- reading


class Loop(NamedTuple):
    """The ``training_loop`` section, as spec values."""

    batch: BatchSpec
    activation_checkpointing: bool
    master_dtype: DType
    loss_scaling: LossScaling
    skip_nonfinite_steps: bool


def read_training_loop(r: SourceKeys) -> Loop:
    """Read ``training_loop``; every absent key takes the default stated in the table."""
    section(r, "training_loop")
    p = "training_loop."
    clip = take(r, p + "clip_grad_norm", minimum=0.0)
    if clip == 0:
        clip = None
        r.mark(p + "clip_grad_norm", Status.EQUIVALENT, "0 means no clipping, as in DeepSpeed: read as null")
    accumulation = take(r, p + "gradient_accumulation_steps", minimum=1, nullable=True)
    if accumulation is None:
        r.mark(p + "gradient_accumulation_steps", Status.EXACT, "null: derived by the loop as global_batch_size / "
               "(micro_batch_size x data-parallel size)")
    sync = choice(r, p + "grad_sync", aliases=GRAD_SYNC_ALIASES)
    micro = take(r, p + "micro_batch_size", minimum=1)
    global_batch = take(r, p + "global_batch_size", minimum=1)
    activation_checkpointing = take(r, p + "activation_checkpointing")
    master = take(r, p + "master_dtype")
    loss: LossScaling = NoLossScale()
    if section(r, p + "loss_scaler") is not None:
        s = p + "loss_scaler."
        init, growth = take(r, s + "init_scale"), take(r, s + "growth_factor")
        backoff, interval = take(r, s + "backoff_factor"), take(r, s + "growth_interval", minimum=1)
        for key, ok, rule in ((s + "init_scale", init > 0, "> 0"), (s + "growth_factor", growth > 1, "> 1"),
                              (s + "backoff_factor", 0 < backoff < 1, "between 0 and 1")):
            if not ok:
                raise r.error(key, f"must be {rule}, got {r.values.get(key)!r}")
        loss = DynamicLossScale(initial_scale=init, growth_factor=growth, backoff_factor=backoff,
                                growth_interval=interval, hysteresis=1, consecutive_hysteresis=False,
                                min_scale=0.0)
    skip_key = p + "skip_nonfinite_steps"
    skip = take(r, skip_key)
    if loss.kind != "none":
        if r.given(skip_key) and not skip:
            raise r.error(skip_key, "false contradicts loss_scaler: the scaler skips every step whose "
                          "gradients are not finite", fix="remove skip_nonfinite_steps or set it to true")
        skip = True
        r.mark(skip_key, Status.DEFAULT if not r.given(skip_key) else Status.EXACT,
               "true: the loss scaler skips steps whose gradients are not finite")
    try:
        batch = BatchSpec(micro_batch_size=micro, accumulation_steps=accumulation, global_batch_size=global_batch,
                          grad_sync=GradSync.ACCUMULATION_BOUNDARY if sync == "no_sync" else GradSync.EVERY_MICRO_STEP,
                          clip_grad_norm=clip)
    except ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise r.error(p + "global_batch_size", message) from None
    return Loop(batch, activation_checkpointing, master, loss, skip)


def check_precision(r: SourceKeys, param_key: str, param: DType, master: DType, loss: LossScaling) -> None:
    """Combinations FSDP runs but the spec cannot state."""
    if master not in (DType.FP32, param):
        raise r.error(param_key, f"compute dtype {torch_dtype_name(param)} with a model loaded in "
                      f"{torch_dtype_name(master)}: the spec states master weights as fp32 or the compute dtype",
                      fix="load the model in float32, or compute in its loaded dtype")
    if loss.kind != "none" and param is not DType.FP16:
        raise r.error("training_loop.loss_scaler", f"a loss scaler only applies to float16 compute, but compute "
                      f"runs in {torch_dtype_name(param)}", fix="set loss_scaler to null")


def accumulate_dtype_for(sync: GradSync, *, master: DType, unsharded: DType) -> DType:
    """Where FSDP sums gradients across micro-batches: reduced shards in the
    loaded dtype; with gradient sync off, unsharded gradients in ``unsharded``."""
    return unsharded if sync is GradSync.ACCUMULATION_BOUNDARY else master


def read_wrap(r: SourceKeys, path: str) -> WrapSpec:
    """``{"transformer_layer_cls": [...]}``, ``{"min_num_params": n}`` or null."""
    data = section(r, path)
    if data is None:
        return RootWrap()
    keys = [k for k in ("transformer_layer_cls", "min_num_params") if k in data]
    if len(keys) != 1:
        raise r.error(path, "give exactly one of transformer_layer_cls and min_num_params",
                      fix="or null for a single unit")
    if keys[0] == "min_num_params":
        return SizeWrap(min_params=take(r, f"{path}.min_num_params", minimum=1))
    key = f"{path}.transformer_layer_cls"
    names = take(r, key)
    if is_auto(names):
        r.mark(key, Status.AUTO, "\"auto\": the model's _no_split_modules, resolved at wrap time")
        return TransformerWrap(layer_classes=AUTO)
    if isinstance(names, str):
        names = names.split(",")
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names) or not names:
        raise r.error(key, f"expected a list of class names or \"auto\", got {shown(names)}",
                      fix='e.g. ["LlamaDecoderLayer"]')
    return TransformerWrap(layer_classes=tuple(dict.fromkeys(n.strip() for n in names)))


def read_mesh(r: SourceKeys, path: str) -> tuple[int, ...] | None:
    """The mesh shape (1-D or 2-D), carrying non-default dimension names."""
    data = section(r, path)
    if data is None:
        return None
    shape = take(r, f"{path}.shape")
    if not isinstance(shape, list) or len(shape) not in (1, 2):
        raise r.error(f"{path}.shape", f"expected [world] or [replicas, shard_size], got {shown(shape)}")
    dims = tuple(as_int(r.located, f"{path}.shape", n, minimum=1) for n in shape)
    names_key = f"{path}.mesh_dim_names"
    names = take(r, names_key)
    if names is not None:
        if (not isinstance(names, list) or len(names) != len(dims) or len(set(names)) != len(names)
                or not all(isinstance(n, str) and n for n in names)):
            raise r.error(names_key, f"expected {len(dims)} distinct names, got {shown(names)}",
                          fix=f"e.g. {shown(DIM_NAMES[len(dims)])}")
        r.carry(names_key, names, DIM_NAMES[len(dims)])
    return dims


# ----------------------------------------------------------------- writing


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
    if not (isinstance(names, list) and len(names) == len(shape)):
        names = DIM_NAMES[len(shape)]
    return {"shape": shape, "mesh_dim_names": list(names)}


def write_offload(spec: StrategySpec, report: Report, plan: StagePlan, *, target: str) -> tuple[bool, bool]:
    """(offload on, pin_memory): FSDP moves parameters, gradients and the
    optimizer step to host memory together, never to NVMe."""
    opt, par = spec.offload.optimizer, spec.offload.parameters
    if not plan.sharded:
        if opt.enabled or par.enabled:
            report.add("offload", Status.NOT_EXPRESSIBLE, "nothing is sharded, and the spec offloads only sharded "
                       "states: no offload written", target=target)
        return False, True
    for name, tier in (("optimizer", opt), ("parameters", par)):
        if tier.device is OffloadDevice.NVME:
            report.add(f"offload.{name}.device", Status.NOT_EXPRESSIBLE, "FSDP has no NVMe tier; not offloaded "
                       "(set device='cpu' to offload to host memory instead)", target=target)
    on_opt, on_par = opt.device is OffloadDevice.CPU, par.device is OffloadDevice.CPU
    if on_par and on_opt:
        report.add("offload", Status.EXACT, "parameters, gradients and the optimizer step in host memory",
                   target=target)
    elif on_par:
        report.add("offload.parameters.device", Status.APPROXIMATED, "FSDP cannot offload parameters alone: "
                   "gradients and the optimizer step move to host memory as well", target=target)
    elif on_opt:
        report.add("offload.optimizer.device", Status.NOT_EXPRESSIBLE, "FSDP cannot offload optimizer state "
                   "alone (its offload moves parameters too); no offload written", target=target)
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
                       f"FSDP: written as {torch_dtype_name(value)}", target=target)
    return param, reduce, master


def write_training_loop(spec: StrategySpec, report: Report, *, param: DType, force_no_sync: bool,
                        clip_api: str) -> dict[str, Any]:
    """The ``training_loop`` section for ``spec``; ``auto`` values resolved and reported."""
    b, p = spec.batch, spec.precision
    out: dict[str, Any] = {}

    def noted(field: str, key: str, value: Any, text: str, status: Status = Status.APPROXIMATED) -> Any:
        report.add(field, status, text, target=f"training_loop.{key}")
        return value

    clip = b.clip_grad_norm
    if is_auto(clip):
        clip = noted("batch.clip_grad_norm", "clip_grad_norm", 1.0,
                     "\"auto\": written as 1.0, what Accelerate and DeepSpeed fill in")
    elif clip == 0:
        clip = noted("batch.clip_grad_norm", "clip_grad_norm", None, "0 means no clipping: written as null",
                     Status.EQUIVALENT)
    elif clip is not None:
        noted("batch.clip_grad_norm", "clip_grad_norm", clip, f"the loop calls {clip_api}(max_norm={clip})",
              Status.EXACT)
    out["clip_grad_norm"] = clip
    steps = b.accumulation_steps
    if is_auto(steps):
        steps = noted("batch.accumulation_steps", "gradient_accumulation_steps", 1,
                      "\"auto\" has no launcher to fill it: written as 1")
    elif steps is None:
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
        out[name] = noted(f"batch.{name}", name, None, "\"auto\": written as null, left to the data loader") \
            if is_auto(value) else value
    out["activation_checkpointing"] = spec.checkpoint.activation_checkpointing
    out["master_dtype"] = torch_dtype_name(p.master_dtype)
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
        report.add("precision.loss_scaling", Status.NOT_EXPRESSIBLE, f"compute runs in {torch_dtype_name(param)}, "
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


# ----------------------------------------------------------------- live objects


def device_type() -> str:
    """The device type meshes are built on."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def with_world_size(spec: StrategySpec, world_size: int | None) -> StrategySpec:
    """``spec`` with the world size of ``world_size`` or of the initialised process group."""
    import torch.distributed as dist

    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    if world_size is None or spec.sharding.world_size == world_size:
        return spec
    if spec.sharding.world_size is not None:
        raise ConfigError(f"the spec is for {spec.sharding.world_size} ranks, but this run has {world_size}",
                          key="sharding.world_size", fix=f"run on {spec.sharding.world_size} ranks, or change the spec")
    data = spec.model_dump()
    data["sharding"]["world_size"] = world_size
    try:
        return StrategySpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def build_mesh(form: dict[str, Any]) -> DeviceMesh | None:
    """The DeviceMesh of a written ``{"shape", "mesh_dim_names"}``; ``None``
    when no process group is initialised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return init_device_mesh(device_type(), tuple(form["shape"]), mesh_dim_names=tuple(form["mesh_dim_names"]))


def layer_classes(names: list[str] | str, module: nn.Module | None) -> set[type[nn.Module]]:
    """The classes named ``names`` (``"auto"``: ``module._no_split_modules``) in ``module``'s tree."""
    key = "wrapping.layer_classes"
    if module is None:
        raise ConfigError("layer classes are given by name: the model is needed to find them", key=key,
                          fix="pass module=model")
    if is_auto(names):
        names = list(getattr(module, "_no_split_modules", None) or ())
        if not names:
            raise ConfigError("\"auto\" takes a Hugging Face model's _no_split_modules, and this model has none",
                              key=key, fix='name the layer classes, e.g. ["LlamaDecoderLayer"]')
    found = {type(m).__name__: type(m) for m in module.modules()}
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(f"no module of class {', '.join(missing)} in the model", key=key,
                          fix=f"use classes the model has: {', '.join(sorted(found))}")
    return {found[n] for n in names}
