"""spec -> a torchtitan job config TOML (``--job.config_file``; the schema of torchtitan 0.2, its last TOML release).

    >>> from zerobridge.load import load_spec
    >>> from zerobridge.translate.torchtitan_write import toml_text, write_torchtitan
    >>> t = write_torchtitan(load_spec("zero3").value)
    >>> print(toml_text(t.value), end="")
    [parallelism]
    data_parallel_replicate_degree = 1
    data_parallel_shard_degree = -1
    fsdp_reshard_after_forward = "default"
    <BLANKLINE>
    [training]
    mixed_precision_param = "bfloat16"
    mixed_precision_reduce = "float32"
    enable_cpu_offload = false
    <BLANKLINE>
    [activation_checkpoint]
    mode = "none"
    <BLANKLINE>
    [compile]
    enable = false
    components = ["model", "loss"]
    backend = "inductor"
    >>> t.report.find("precision.param_dtype").status.value
    'default'

torchtitan applies FSDP2 itself, one ``fully_shard`` unit per TransformerBlock,
so the writer fills the sections torchtitan reads for it: ``[parallelism]``
(the data-parallel degrees and ``fsdp_reshard_after_forward``), ``[training]``
(mixed precision, CPU offload, clipping, batch), ``[activation_checkpoint]``,
``[compile]`` and ``[quantize.linear.float8]`` (a source's older ``[float8]``
section keeps its form). What torchtitan has no form for is refused with
a ``ConfigError`` naming it: fp16 compute (torchtitan trains in bf16 or fp32),
NVMe offload, and layouts whose degrees need a world size the spec lacks.
What it approximates is reported (ZeRO-1/2 as ``never`` reshard, one-sided
CPU offload, selective or per-module units). A torchtitan source's other
sections (``[job]``, ``[model]``, ``[optimizer]``, ...) come back from
``passthrough["torchtitan"]`` unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, StrategySpec, WireFormat, is_auto
from zerobridge.spec.communication import CommunicationSpec
from zerobridge.translate.report import Impact, Report, Status, Translation

__all__ = ["FORMAT", "toml_text", "write_torchtitan"]

FORMAT = "torchtitan"
_NAMES = {DType.BF16: "bfloat16", DType.FP32: "float32"}
_FLOAT8 = "quantize.linear.float8"
"""torchtitan 0.2's float8 section and converter name (older configs: ``[float8]`` and ``"float8"``)."""


def _refuse(key: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{what}: torchtitan has no form for it", key=key, fix=fix)


def _degrees(spec: StrategySpec, report: Report) -> dict[str, Any]:
    s = spec.sharding
    world, group = s.world_size, s.shard_group
    out: dict[str, Any] = {}
    if s.stage == 0:
        if world is None:
            raise _refuse("sharding.stage", "stage 0 (DDP) without a world size",
                          "pass --world-size N: torchtitan's data_parallel_replicate_degree must be stated")
        out |= {"data_parallel_replicate_degree": world, "data_parallel_shard_degree": 1}
        report.add("sharding", Status.EXACT, f"DDP over {world} replicas", target="parallelism")
        return out
    if s.is_hybrid:
        if not isinstance(group, int) or world is None:
            raise _refuse("sharding.shard_group", f"hybrid shard group {group!r} without a number of ranks and a "
                          "world size",
                          "pass --world-size N and a numeric shard group: torchtitan needs both degrees")
        out |= {"data_parallel_replicate_degree": world // group, "data_parallel_shard_degree": group}
        report.add("sharding.shard_group", Status.EXACT, f"HSDP: {world // group} replicas of {group} shards",
                   target="parallelism.data_parallel_shard_degree")
    else:
        out |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1}
        report.add("sharding.shard_group", Status.EXACT, "-1: every data-parallel rank shards",
                   target="parallelism.data_parallel_shard_degree")
    after_forward = s.parameters.value == "reshard_after_forward"
    out["fsdp_reshard_after_forward"] = "default" if after_forward else "never"
    if s.stage in (1, 2):
        report.add("sharding", Status.APPROXIMATED, f"ZeRO-{s.stage.value} keeps parameters whole between steps; "
                   "torchtitan's FSDP2 shards them at rest and gathers them once per step (reshard never)",
                   target="parallelism.fsdp_reshard_after_forward")
    else:
        report.add("sharding.parameters", Status.EXACT, "default: resharded after forward (no pipeline stages)"
                   if after_forward else "never: kept gathered until backward ends",
                   target="parallelism.fsdp_reshard_after_forward")
    if s.backward_gather_group is not None:
        report.add("sharding.backward_gather_group", Status.NOT_EXPRESSIBLE, "torchtitan reshards to the whole "
                   "shard group: no secondary (hpZ) group", impact=Impact.SPEED)
    return out


def _training(spec: StrategySpec, report: Report) -> dict[str, Any]:
    p, b, o = spec.precision, spec.batch, spec.offload
    out: dict[str, Any] = {}
    if is_auto(p.param_dtype):
        out["mixed_precision_param"] = "bfloat16"
        report.add("precision.param_dtype", Status.DEFAULT, "left to the script: torchtitan's default bfloat16",
                   target="training.mixed_precision_param")
    elif p.param_dtype in _NAMES:
        out["mixed_precision_param"] = _NAMES[DType(p.param_dtype)]
        report.add("precision.param_dtype", Status.EXACT, target="training.mixed_precision_param")
    else:
        raise _refuse("precision.param_dtype", f"compute dtype {DType(p.param_dtype).value}",
                      "torchtitan computes in bfloat16 or float32: convert with --precision bf16")
    out["mixed_precision_reduce"] = "float32"
    if not is_auto(p.reduce_dtype) and p.reduce_dtype != DType.FP32:
        report.add("precision.reduce_dtype", Status.APPROXIMATED, f"torchtitan reduces gradients in float32 only, "
                   f"not {DType(p.reduce_dtype).value}", target="training.mixed_precision_reduce")
    if p.master_dtype != DType.FP32:
        report.add("precision.master_dtype", Status.APPROXIMATED, "torchtitan keeps fp32 sharded parameters "
                   "(FSDP2's mixed precision); pure 16-bit weights have no form", target="training")
    if "nvme" in (o.optimizer.device.value, o.parameters.device.value):
        raise _refuse("offload", "offload to nvme", "torchtitan offloads to host memory only: use cpu")
    both = o.optimizer.enabled and o.parameters.enabled
    out["enable_cpu_offload"] = o.optimizer.enabled or o.parameters.enabled
    if out["enable_cpu_offload"] and not both:
        report.add("offload", Status.APPROXIMATED, "torchtitan's CPUOffloadPolicy moves parameters, gradients and "
                   "the optimizer step to host memory together", target="training.enable_cpu_offload")
    elif both:
        report.add("offload", Status.EXACT, target="training.enable_cpu_offload")
    if b.clip_grad_norm is None:
        out["max_norm"] = math.inf
        report.add("batch.clip_grad_norm", Status.EQUIVALENT, "no clipping: torchtitan always clips, at inf it "
                   "never scales", target="training.max_norm")
    elif not is_auto(b.clip_grad_norm):
        out["max_norm"] = float(b.clip_grad_norm)
        report.add("batch.clip_grad_norm", Status.EXACT, target="training.max_norm")
    else:
        report.add("batch.clip_grad_norm", Status.DEFAULT, "left to the script: torchtitan's default 1.0",
                   target="training.max_norm")
    _batch(spec, out, report)
    return out


def _batch(spec: StrategySpec, out: dict[str, Any], report: Report) -> None:
    b, world = spec.batch, spec.sharding.world_size
    micro, steps, total = b.micro_batch_size, b.accumulation_steps, b.global_batch_size
    if isinstance(micro, int):
        out["local_batch_size"] = micro
        report.add("batch.micro_batch_size", Status.EXACT, target="training.local_batch_size")
    if isinstance(total, int):
        out["global_batch_size"] = total
        report.add("batch.global_batch_size", Status.EXACT, target="training.global_batch_size")
    elif isinstance(steps, int) and steps > 1:
        if isinstance(micro, int) and world is not None:
            out["global_batch_size"] = micro * steps * world
            report.add("batch.accumulation_steps", Status.EQUIVALENT, f"global = {micro} x {steps} x {world} ranks: "
                       "torchtitan accumulates global / (local x data-parallel degree) micro-batches",
                       target="training.global_batch_size")
        else:
            raise _refuse("batch.accumulation_steps", f"accumulation {steps} without a micro batch and world size",
                          "pass --micro-batch and --world-size: torchtitan states accumulation as a global batch")


def _checkpointing(spec: StrategySpec, report: Report) -> dict[str, Any]:
    on = spec.checkpoint.activation_checkpointing
    w = spec.wrapping
    report.add("checkpoint.activation_checkpointing", Status.EXACT, "full: every TransformerBlock recomputed" if on
               else "", target="activation_checkpoint.mode")
    if w.policy in ("transformer",):
        report.add("wrapping", Status.EQUIVALENT, "torchtitan's units are its own TransformerBlocks (and the "
                   "embedding, and the norm with the output layer)", target="parallelism")
    elif spec.sharding.stage == 3:
        report.add("wrapping", Status.APPROXIMATED, f"{w.policy} units: torchtitan shards each TransformerBlock "
                   "as its own unit", target="parallelism", impact=Impact.MEMORY)
    if spec.checkpoint.format != "sharded" and not is_auto(spec.checkpoint.format):
        report.add("checkpoint.format", Status.APPROXIMATED, "torchtitan saves DCP shards (checkpoint.export_dtype "
                   "converts the last save)", target="checkpoint")
    return {"mode": "full" if on else "none"}


def _compile(spec: StrategySpec, report: Report) -> dict[str, Any]:
    c = spec.compile
    if not c.enabled:
        return {"enable": False, "components": ["model", "loss"], "backend": c.backend}
    report.add("compile.enabled", Status.EQUIVALENT, "every TransformerBlock compiled with fullgraph=True",
               target="compile.enable")
    if c.mode.value != "default" or c.dynamic is not None:
        report.add("compile.mode", Status.NOT_EXPRESSIBLE, "torchtitan passes no mode or dynamic to torch.compile",
                   impact=Impact.SPEED)
    return {"enable": True, "components": ["model"], "backend": c.backend}


def _float8(spec: StrategySpec, report: Report, section: str) -> dict[str, Any] | None:
    wire = spec.communication.wire
    for name in ("grad_reduce", "frozen_weights"):
        if getattr(wire, name) is not WireFormat.FULL:
            report.add(f"communication.wire.{name}", Status.NOT_EXPRESSIBLE, "torchtitan reduces and gathers these "
                       "in full precision", target="parallelism")
    if wire.param_gather is not WireFormat.FP8:
        if wire.param_gather is not WireFormat.FULL:
            report.add("communication.wire.param_gather", Status.NOT_EXPRESSIBLE, "torchtitan gathers float8 or "
                       f"full weights, not {wire.param_gather.value}")
        return None
    report.add("communication.wire.param_gather", Status.APPROXIMATED, "float8 all-gathers through torchao's "
               f"float8 linear layers (model.converters = [\"{section}\"]), whose matmuls run in fp8 too; torchao "
               "scales per tensor, the native engine per shard", target=f"{section}.enable_fsdp_float8_all_gather")
    return {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_torchtitan(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """The torchtitan TOML (as a dict of sections) that runs ``spec``; ``ConfigError`` naming what has no form."""
    report = Report(source="spec", target=FORMAT)
    written: dict[str, Any] = {"parallelism": _degrees(spec, report), "training": _training(spec, report),
                               "activation_checkpoint": _checkpointing(spec, report)}
    written["compile"] = _compile(spec, report)
    carried: dict[str, Any] = dict(spec.passthrough.get(FORMAT) or {})
    legacy = "float8" in carried  # a source with the older [float8] section keeps its schema
    float8 = _float8(spec, report, "float8" if legacy else _FLOAT8)
    if float8:
        written |= {"float8": float8} if legacy else {"quantize": {"linear": {"float8": float8}}}
        written["model"] = {"converters": ["float8" if legacy else _FLOAT8]}
    elif legacy:  # the source's section: say the gather is off in it
        written["float8"] = {"enable_fsdp_float8_all_gather": False}
    if spec.communication.model_dump() != CommunicationSpec().model_dump() and spec.sharding.stage != 0:
        report.add("communication", Status.NOT_EXPRESSIBLE, "torchtitan's FSDP2 sizes its gathers per block and "
                   "prefetches one block ahead: no bucket or prefetch setting", impact=Impact.SPEED)
    model = carried.get("model")
    converters = model.get("converters") if isinstance(model, dict) else None
    if float8 and converters is not None:  # keep the source's other converters, float8 among them
        names = converters.split(",") if isinstance(converters, str) else list(converters)
        names = names if {"float8", _FLOAT8} & set(names) else [*names, _FLOAT8]
        written["model"]["converters"] = ",".join(names) if isinstance(converters, str) else names
    for section in (s for s in spec.passthrough if s != FORMAT):
        report.add(f"passthrough.{section}", Status.NOT_ABOUT_SHARDING, f"the {section} source's own sections "
                   "are not torchtitan keys: set [optimizer] and [lr_scheduler] by hand")
    return Translation(_merge(carried, written), report)


# ------------------------------------------------------------------------------------------------ TOML


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, where) for v in value) + "]"
    raise ConfigError(f"{where}: cannot write {type(value).__name__} {value!r} as a TOML value")


def toml_text(data: dict[str, Any]) -> str:
    """TOML text for nested sections of scalars and lists (the shape of a torchtitan job config)."""
    lines: list[str] = []

    def table(prefix: str, node: dict[str, Any]) -> None:
        plain = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if prefix and (plain or not node):
            lines.extend(["", f"[{prefix}]"] if lines else [f"[{prefix}]"])
        lines.extend(f"{_key(k)} = {_value(v, f'{prefix}.{k}' if prefix else k)}" for k, v in plain.items())
        for key, value in node.items():
            if isinstance(value, dict):
                table(f"{prefix}.{_key(key)}" if prefix else _key(key), value)

    table("", data)
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if key.replace("_", "a").replace("-", "a").isalnum() else json.dumps(key)
