"""HF Accelerate config YAML -> spec, read the way ``accelerate launch`` reads it.

    >>> from zerobridge.translate.sources import parse_yaml
    >>> from zerobridge.translate.accelerate_read import read_accelerate
    >>> text = '''
    ... distributed_type: FSDP
    ... mixed_precision: bf16
    ... num_processes: 8
    ... fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: false}
    ... '''
    >>> spec = read_accelerate(parse_yaml(text, "fsdp.yaml")).value
    >>> spec.summary()
    'stage 3, params reshard_after_backward, compute bf16'
    >>> (spec.precision.master_dtype.value, spec.sharding.world_size)
    ('fp32', 8)

Reading turns the YAML into the FSDP1/FSDP2 keyword arguments or the DeepSpeed
JSON that Accelerate itself would build and hands them to the FSDP and DeepSpeed
readers; this module adds only what Accelerate decides: the launcher's defaults
and quirks, the world size, hybrid groups, its fp32 upcast and GradScaler.
The FSDP plugin is read in ``accelerate_fsdp``, the writers are in
``accelerate_write``, and what all three share (key prefixes, the launcher's
key spelling, running a delegate reader) in ``accelerate_common``;
``SourceKeys`` (the key reader every translator shares) is in ``keys``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import AUTO, DType, Stage, StrategySpec, WireFormat, is_auto
from zerobridge.translate.accelerate_common import FORMAT, D, P, call_reader, carry_machines, launcher_prefix
from zerobridge.translate.accelerate_fsdp import read_fsdp_plugin
from zerobridge.translate.compilation import read_dynamo
from zerobridge.translate.compute_copy import note_layout
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.keys import SourceKeys, chain_report, update_spec
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.run_level import leave_to_script
from zerobridge.translate.sources import Located, note_lenient, parse_json, read_text
from zerobridge.translate.wire import FLOAT8_SCALES

__all__ = ["read_accelerate"]

_MIXED = {"fp16": DType.FP16, "bf16": DType.BF16, "fp8": DType.BF16}
_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                   "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                   "zero3_save_16bit_model")
"""Inline keys Accelerate refuses next to a deepspeed_config_file (with a top-level mixed_precision)."""
_SECTIONS = {"FSDP": "fsdp_config", "DEEPSPEED": "deepspeed_config"}
GRAD_SCALER = {"kind": "dynamic", "initial_scale": 2.0**16, "growth_interval": 2000, "growth_factor": 2.0,
               "backoff_factor": 0.5, "hysteresis": 1, "consecutive_hysteresis": False, "min_scale": 0.0}
"""torch's GradScaler defaults, which Accelerate uses for fp16 outside DeepSpeed."""

# ---------------------------------------------------------------------------------------------- reading

def read_accelerate(located: Located, *, base_dir: Path | None = None) -> Translation[StrategySpec]:
    """The spec an Accelerate config YAML means, and a key-by-key report.

    ``base_dir``: where a relative ``deepspeed_config_file`` is looked up (the
    directory ``accelerate launch`` runs in); default: the YAML's directory.
    """
    report = Report(source=FORMAT, target="spec")
    keys = SourceKeys(located, load_table(FORMAT), report, consumer="Accelerate", bools="accelerate",
                      normalize=launcher_prefix)
    if not keys.given("distributed_type"):
        raise located.error("no distributed_type: Accelerate refuses a config without one",
                            fix="add distributed_type: FSDP, DEEPSPEED or MULTI_GPU")
    kind = keys.get("distributed_type")
    keys.note("distributed_type")
    mixed = _mixed_precision(keys)
    world = keys.get("num_processes")
    world = world if isinstance(world, int) and world > 0 else None
    if kind == "FSDP":
        spec = read_fsdp_plugin(keys, mixed, world)
    elif kind == "DEEPSPEED":
        spec = _read_deepspeed(keys, mixed, world, base_dir)
    elif kind in ("XLA", "MEGATRON_LM"):
        raise located.error(f"distributed_type {kind} is neither ZeRO nor FSDP data parallelism",
                            key=keys.key("distributed_type"), fix="use FSDP, DEEPSPEED or a MULTI_* type")
    else:
        spec = _read_ddp(keys, kind, mixed, world)
    if kind != "DEEPSPEED":
        # Accelerate's FSDP and DDP configs hold no batch, accumulation or clipping; without
        # mixed_precision the launcher's --mixed_precision (Trainer's --bf16/--fp16) decides.
        spec = leave_to_script(spec, report, consumer="Accelerate",
                               precision=not (keys.given("mixed_precision") or keys.given("fp16")))
    for section in ("fsdp_config", "deepspeed_config"):
        if _SECTIONS.get(kind) != section:
            for path in [p for p in keys.values if p.startswith(section + ".")]:
                keys.note(path, Status.IGNORED, f"distributed_type is {kind}: Accelerate does not read {section}")
    fp8 = keys.carried.get("fp8_config")
    if mixed == "fp8" and isinstance(fp8, dict) and str(fp8.get("enable_fsdp_float8_all_gather")).lower() == "true":
        if kind == "FSDP" and spec.sharding.parameters.sharded_at_rest:
            spec = update_spec(spec, {"communication.wire.param_gather": WireFormat.FP8}, source=located.source)
            report.add("fp8_config.enable_fsdp_float8_all_gather", Status.APPROXIMATED, "float8 e4m3 parameter "
                       f"all-gathers through torchao (the fp8 matmuls are reported with mixed_precision): "
                       f"{FLOAT8_SCALES}", target="communication.wire.param_gather")
        else:
            report.add("fp8_config.enable_fsdp_float8_all_gather", Status.IGNORED, "takes effect only when FSDP "
                       "shards the parameters: nothing is gathered here", target="communication.wire.param_gather")
    compiled = read_dynamo(keys, deepspeed=kind == "DEEPSPEED")
    if compiled is not None:
        spec = update_spec(spec, {"compile": compiled}, source=located.source)
    keys.note_rest()
    carried = keys.passthrough()
    if carried:
        spec = update_spec(spec, {"passthrough": {**spec.passthrough, FORMAT: carried}}, source=located.source)
    return Translation(spec, report)


def _mixed_precision(keys: SourceKeys) -> str:
    if keys.given("fp16") and not keys.given("mixed_precision"):
        keys.note("fp16")
        return "fp16" if keys.flag("fp16") else "no"
    if keys.given("fp16"):
        keys.note("fp16", Status.IGNORED, "mixed_precision is given, so Accelerate drops it")
    mixed: str = keys.get("mixed_precision")
    if mixed == "fp8":
        keys.note("mixed_precision", Status.APPROXIMATED, "fp8 matmuls are not expressible: read as the bf16 policy")
    else:
        keys.note("mixed_precision")
    return mixed


def _scaling(mixed: str) -> dict[str, Any]:
    return {"loss_scaling": GRAD_SCALER, "skip_nonfinite_steps": True} if mixed == "fp16" else {}


def _read_ddp(keys: SourceKeys, kind: str, mixed: str, world: int | None) -> StrategySpec:
    compute = _MIXED.get(mixed, DType.FP32)
    carry_machines(keys, "DDP replicates over every process of every machine")
    keys.report.add("distributed_type", Status.EQUIVALENT, f"{kind} is DDP: ZeRO stage 0, gradients all-reduced "
                    f"in fp32 under autocast{', with a GradScaler' if mixed == 'fp16' else ''}", target="sharding")
    layout = note_layout(keys.report, "autocast", key="mixed_precision") if compute is not DType.FP32 else "stored"
    return StrategySpec.model_validate({
        "sharding": {"world_size": 1 if kind == "NO" else world},
        "precision": {"param_dtype": compute, "master_dtype": DType.FP32, "reduce_dtype": DType.FP32,
                      "accumulate_dtype": DType.FP32, "compute_copy": layout, **_scaling(mixed)},
        "batch": {"grad_sync": "accumulation_boundary"}, "checkpoint": {"format": "full"}})


_DS_RENAMES = {
    "zero_optimization.stage": D + "zero_stage", "gradient_clipping": D + "gradient_clipping",
    "zero_optimization.offload_optimizer.device": D + "offload_optimizer_device",
    "zero_optimization.offload_param.device": D + "offload_param_device",
    "zero_optimization.offload_optimizer.nvme_path": D + "offload_optimizer_nvme_path",
    "zero_optimization.offload_param.nvme_path": D + "offload_param_nvme_path",
    "gradient_accumulation_steps": D + "gradient_accumulation_steps", "fp16.enabled": "mixed_precision",
    "bf16.enabled": "mixed_precision",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": D + "zero3_save_16bit_model",
    "zero_optimization.leaf_module": D + "deepspeed_moe_layer_cls_names",
}


def _read_deepspeed(keys: SourceKeys, mixed: str, world: int | None, base_dir: Path | None) -> StrategySpec:
    loc, file_key = keys.located, D + "deepspeed_config_file"
    carry_machines(keys, "ZeRO partitions over every process of every machine")
    for n in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        path = f"{P}{n}_size"
        if keys.given(path):
            size = keys.get(path)
            keys.note(path, Status.IGNORED if n.startswith("dp") else None if size > 1 else Status.EXACT,
                      "ZeRO partitions over DeepSpeed's own data-parallel group" if n.startswith("dp") else
                      "" if size > 1 else "off")
    moe = [c.strip() for c in str(keys.get(D + "deepspeed_moe_layer_cls_names") or "").split(",") if c.strip()]
    file = keys.get(file_key)
    if file not in (None, "none"):
        clash = [k for k in _FILE_EXCLUSIVE if keys.given(D + k)]
        clash += ["mixed_precision"] if keys.given("mixed_precision") else []
        if clash:
            first = keys.key(D + clash[0]) if clash[0] != "mixed_precision" else "mixed_precision"
            raise loc.error(f"{', '.join(clash)} cannot be set next to deepspeed_config_file: the file is the whole "
                            "DeepSpeed config (Accelerate raises)", key=first,
                            fix="put them in the JSON (fp16/bf16 for mixed_precision) or drop deepspeed_config_file")
        ds_path = Path(str(file))
        if not ds_path.is_absolute():
            ds_path = (base_dir if base_dir is not None else Path(loc.source).resolve().parent) / ds_path
        try:
            ds_loc = parse_json(read_text(ds_path), str(ds_path))
        except ConfigError as exc:
            if exc.source != str(ds_path):
                raise
            raise loc.error(f"deepspeed_config_file {str(file)!r}: {ds_path}: {exc.message}", key=keys.key(file_key),
                            fix="give a path relative to where accelerate launch runs (base_dir) or an absolute "
                                "one") from None
        note_lenient(ds_loc, keys.report)
        data = dict(ds_loc.data)
        if not isinstance(data.get("zero_optimization"), dict):
            raise ds_loc.error("no zero_optimization section: Accelerate requires one", key="zero_optimization",
                               fix='add "zero_optimization": {"stage": ...}')
        data.setdefault("gradient_accumulation_steps", 1)
        t = read_deepspeed(Located(data, ds_loc.source, ds_loc.text, ds_loc.lines))
        keys.report.extend(t.report)
        if "gradient_accumulation_steps" not in ds_loc.data:
            keys.report.add("gradient_accumulation_steps", Status.DEFAULT, "absent from the file: Accelerate sets 1",
                            target="batch.accumulation_steps")
        keys.report.add(keys.key(file_key), Status.EXACT, f"read {ds_path}", target="")
        spec = t.value
        if moe and spec.sharding.stage is Stage.PARAMETERS:
            leaves = tuple(dict.fromkeys((*getattr(spec.wrapping, "leaf_classes", ()), *moe)))
            spec = update_spec(spec, {"wrapping": {"policy": "every_module", "leaf_classes": leaves}})
            keys.note(D + "deepspeed_moe_layer_cls_names")
        elif moe:
            keys.report.add(keys.key(D + "deepspeed_moe_layer_cls_names"), Status.EXACT,
                            "unused below stage 3: ZeRO leaf modules only change stage-3 gathering")
    else:
        spec = _inline_deepspeed(keys, mixed, moe)
    return update_spec(spec, {"sharding.world_size": world}, source=loc.source)


def _inline_deepspeed(keys: SourceKeys, mixed: str, moe: list[str]) -> StrategySpec:
    """The JSON Accelerate's DeepSpeedPlugin builds from the inline keys, read by the DeepSpeed reader."""
    zero: dict[str, Any] = {"stage": keys.get(D + "zero_stage")}
    for tier, short in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
        device, nvme = keys.get(f"{D}offload_{short}_device"), f"{D}offload_{short}_nvme_path"
        if device != "none":
            zero[tier] = {"device": device}
        if device == "nvme":
            if keys.get(nvme) in (None, "none"):
                raise keys.located.error(f"offload_{short}_device is nvme but offload_{short}_nvme_path is not set",
                                         key=keys.key(nvme), fix="give the swap directory")
            zero[tier]["nvme_path"] = keys.get(nvme)
            keys.note(nvme)
        elif keys.given(nvme):
            keys.note(nvme, Status.EXACT, "unused: the device is not nvme")
    if keys.get(D + "zero3_save_16bit_model"):
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if moe:
        zero["leaf_module"] = {"classes": moe}
    config: dict[str, Any] = {"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO,
                              "gradient_accumulation_steps": keys.get(D + "gradient_accumulation_steps"),
                              "zero_optimization": zero,
                              "fp16": {"enabled": mixed == "fp16", **({"auto_cast": True} if mixed == "fp16" else {})},
                              "bf16": {"enabled": mixed in ("bf16", "fp8")}}
    clip = keys.get(D + "gradient_clipping")
    if clip:
        config["gradient_clipping"] = clip
    for name in ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                 "zero3_save_16bit_model"):
        keys.note(D + name)
    if moe and zero.get("stage") != 3:
        keys.note(D + "deepspeed_moe_layer_cls_names", Status.EXACT,
                  "unused below stage 3: ZeRO leaf modules only change stage-3 gathering")
    else:
        keys.note(D + "deepspeed_moe_layer_cls_names")
    if clip:
        keys.note(D + "gradient_clipping",
                  extra="\"auto\" becomes 1.0 when the model is prepared" if is_auto(clip) else "")
    else:
        keys.note(D + "gradient_clipping", Status.IGNORED, "0 is not written to the JSON, so DeepSpeed's own default "
                  "applies (1.0 since 0.19.3); turn clipping off in a deepspeed_config_file")
    t = call_reader(keys.located, read_deepspeed, config, "DeepSpeed JSON", D + "zero_stage")
    chain_report(keys.report, t.report, _DS_RENAMES, "DeepSpeed JSON")
    return t.value
