"""PyTorch Lightning strategy names <-> spec.

    >>> from zerobridge.translate.lightning import read_lightning, write_lightning
    >>> spec = read_lightning("deepspeed_stage_2_offload").value
    >>> spec.summary()
    'stage 2, params replicated, offload optimizer=cpu params=none, compute auto'
    >>> spec.communication.reduce_bucket, spec.offload.optimizer.pin_memory, spec.batch.clip_grad_norm
    (200000000, False, 'auto')
    >>> write_lightning(spec).value["strategy"]
    'deepspeed_stage_2_offload'
    >>> read_lightning("lightning:fsdp", precision="bf16-mixed").value.precision.reduce_dtype.value
    'bf16'

A registry name (``mappings/lightning.toml``) stands for constructor arguments;
they are turned into the DeepSpeed JSON or the FSDP1 keyword arguments that
Lightning itself builds from them, which the DeepSpeed and FSDP1 readers read.
Trainer arguments that shape that config (precision, accumulate_grad_batches,
gradient_clip_val) may be passed along with the constructor arguments.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError, closest
from zerobridge.spec import DType, StrategySpec, is_auto
from zerobridge.translate.carried import report_carried
from zerobridge.translate.compilation import no_compile_form
from zerobridge.translate.compute_copy import note_layout, write_compute_copy
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.fsdp1 import read_fsdp1
from zerobridge.translate.keys import SourceKeys, spec_diff, update_spec
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.run_level import leave_to_script
from zerobridge.translate.sources import Located, parse_json, read_text

__all__ = ["lightning_names", "read_lightning", "write_lightning"]

FORMAT = "lightning"
_SIXTEEN = {"16-mixed": (DType.FP16, True), "16": (DType.FP16, True), "16-true": (DType.FP16, False),
            "bf16-mixed": (DType.BF16, True), "bf16": (DType.BF16, True), "bf16-true": (DType.BF16, False)}
"""Trainer precision -> (16-bit dtype, whether fp32 weights are kept under it)."""
_TORCH = {DType.FP32: "float32", DType.BF16: "bfloat16", DType.FP16: "float16"}
_DS_HINT = "pass config=<the DeepSpeed JSON from `zerobridge convert --to deepspeed`> to DeepSpeedStrategy"


@cache
def _registry() -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in load_table(FORMAT).named}


def lightning_names() -> list[str]:
    """Every registry name zerobridge reads (both lightning.pytorch's and lightning.fabric's)."""
    return list(_registry())


def read_lightning(name: str, *, fabric: bool = False, **kwargs: Any) -> Translation[StrategySpec]:
    """The spec a Lightning strategy name means, with constructor or Trainer arguments ``kwargs``
    overriding its defaults. ``fabric``: read as lightning.fabric (FSDP saves sharded state)."""
    name = name.removeprefix("lightning:")
    if name not in _registry():
        match = closest(name, _registry())
        raise ConfigError(f"unknown Lightning strategy {name!r}", source="lightning",
                          fix=f"did you mean {match!r}?" if match else f"use one of: {', '.join(_registry())}")
    entry, table = _registry()[name], load_table(FORMAT)
    cls = entry["class"]
    report = Report(source=f"{FORMAT}:{name}", target="spec")
    fabric_only = bool(entry.get("fabric_only"))
    report.add("strategy", Status.EXACT, entry["note"] + (" (not in lightning.pytorch's registry: there pass "
               "DeepSpeedStrategy(stage=1, offload_optimizer=True))" if fabric_only and not fabric else ""),
               target="sharding")
    data: dict[str, dict[str, Any]] = {cls: dict(entry["kwargs"]), "Trainer": {}}
    known = table.children(cls) + table.children("Trainer")
    for key, value in kwargs.items():
        if key not in known:
            match = closest(key, known)
            raise ConfigError(f"unknown argument {key!r} for {cls} or the Trainer", source=f"lightning:{name}",
                              key=key, fix=f"did you mean {match!r}?" if match else f"valid: {', '.join(known)}")
        data["Trainer" if key in table.children("Trainer") else cls][key] = value
    located = Located(data, f"lightning:{name}")
    keys = SourceKeys(located, table, report, consumer="Lightning", bools="accelerate")
    if cls == "DDPStrategy":
        spec = _read_ddp(keys)
    elif cls == "DeepSpeedStrategy":
        t: Translation[StrategySpec] = read_deepspeed(
            Located(_deepspeed_json(keys, fabric_only), f"lightning:{name} (DeepSpeed JSON)"))
        report.extend(t.report)
        spec = t.value
    else:
        t = read_fsdp1(Located(_fsdp_kwargs(keys, fabric), f"lightning:{name} (FSDP1 kwargs)"))
        report.extend(t.report)
        spec = t.value
    keys.note_rest()
    stated = tuple(field for path, field in (("Trainer.accumulate_grad_batches", "accumulation_steps"),
                                             ("Trainer.gradient_clip_val", "clip_grad_norm")) if keys.given(path))
    if keys.given("DeepSpeedStrategy.config"):
        stated += ("micro_batch_size", "global_batch_size")
    spec = leave_to_script(spec, report, consumer="Lightning", stated=stated,
                           precision=not keys.given("Trainer.precision"))
    carried = keys.passthrough()
    if carried:
        spec = update_spec(spec, {"passthrough": {**spec.passthrough, FORMAT: carried}})
    return Translation(spec, report)


def _trainer_precision(keys: SourceKeys) -> tuple[DType, bool]:
    precision = keys.get("Trainer.precision")
    keys.note("Trainer.precision")
    return _SIXTEEN.get(precision, (DType.FP32, True))


def _read_ddp(keys: SourceKeys) -> StrategySpec:
    dtype, mixed = _trainer_precision(keys)
    master = DType.FP32 if mixed else dtype
    scaling = {"loss_scaling": {"kind": "dynamic", "initial_scale": 2.0**16, "growth_interval": 2000,
                                "hysteresis": 1, "min_scale": 0.0}, "skip_nonfinite_steps": True} \
        if dtype == DType.FP16 and mixed else {}
    for path in ("Trainer.accumulate_grad_batches", "Trainer.gradient_clip_val"):
        keys.note(path)
    layout = note_layout(keys.report, "autocast", key="Trainer.precision") if mixed and dtype is not DType.FP32 \
        else "stored"
    return StrategySpec.model_validate({
        "precision": {"param_dtype": dtype, "master_dtype": master, "reduce_dtype": master,
                      "accumulate_dtype": master, "compute_copy": layout, **scaling},
        "batch": {"accumulation_steps": keys.get("Trainer.accumulate_grad_batches"), "grad_sync":
                  "accumulation_boundary", "clip_grad_norm": keys.get("Trainer.gradient_clip_val") or None},
        "checkpoint": {"format": "full"}})


def _deepspeed_json(keys: SourceKeys, fabric_only: bool) -> dict[str, Any]:
    """The DeepSpeed config DeepSpeedStrategy builds from its arguments, plus what it adds at setup."""
    d = "DeepSpeedStrategy."

    def arg(name: str) -> Any:
        keys.note(d + name)
        return keys.get(d + name)

    config = keys.get(d + "config")
    if config is not None:
        keys.note(d + "config", Status.EXACT, "the whole DeepSpeed config")
        if isinstance(config, (str, Path)):
            config = parse_json(read_text(config), str(config)).data
        if not isinstance(config, dict):
            raise keys.located.error("expected a dict or a path to a DeepSpeed JSON", key=d + "config")
        config = dict(config)
        for path in keys.values:
            if path.startswith(d) and path != d + "config":
                keys.note(path, Status.IGNORED, "Lightning ignores its ZeRO arguments when config is given")
    else:
        zero: dict[str, Any] = {name: arg(name) for name in (
            "stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
            "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")}
        nvme_path, pin = arg("nvme_path"), arg("pin_memory")
        if arg("offload_optimizer"):
            device = arg("offload_optimizer_device")
            zero["offload_optimizer"] = {"device": device, "buffer_count": arg("optimizer_buffer_count"),
                                         "pin_memory": pin, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        if arg("offload_parameters"):
            device = arg("offload_params_device")
            zero["offload_param"] = {"device": device, "buffer_count": arg("params_buffer_count"),
                                     "buffer_size": arg("params_buffer_size"), "max_in_cpu": arg("max_in_cpu"),
                                     "pin_memory": pin, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        config = {
            "activation_checkpointing": {k: arg(k) for k in ("partition_activations", "cpu_checkpointing",
                                                              "contiguous_memory_optimization",
                                                              "synchronize_checkpoint_boundary")},
            "aio": {k: arg(k) for k in ("block_size", "queue_depth", "single_submit", "overlap_events",
                                        "thread_count")},
            "zero_allow_untested_optimizer": arg("zero_allow_untested_optimizer"),
        }
        if arg("zero_optimization"):
            config["zero_optimization"] = zero
    if "gradient_accumulation_steps" in config:
        raise keys.located.error("the DeepSpeed config sets gradient_accumulation_steps: Lightning raises",
                                 key=d + "config", fix="use Trainer(accumulate_grad_batches=...)")
    config["gradient_accumulation_steps"] = keys.get("Trainer.accumulate_grad_batches")
    keys.note("Trainer.accumulate_grad_batches")
    clip = keys.get("Trainer.gradient_clip_val")
    config.setdefault("gradient_clipping", clip or 0.0)
    keys.note("Trainer.gradient_clip_val", extra="" if clip else "Lightning writes gradient_clipping: 0.0, so "
              "DeepSpeed's default of 1.0 never applies")
    dtype, _ = _trainer_precision(keys)
    if "fp16" not in config and "bf16" not in config:
        if dtype == DType.FP16:
            config["fp16"] = {"enabled": True, "loss_scale": keys.get(d + "loss_scale"),
                              "initial_scale_power": keys.get(d + "initial_scale_power"),
                              "loss_scale_window": keys.get(d + "loss_scale_window"),
                              "hysteresis": keys.get(d + "hysteresis"),
                              "min_loss_scale": keys.get(d + "min_loss_scale")}
        elif dtype == DType.BF16:
            config["bf16"] = {"enabled": True}
    return config


def _fsdp_kwargs(keys: SourceKeys, fabric: bool) -> dict[str, Any]:
    """The FSDP1 keyword arguments FSDPStrategy passes, plus the training-loop settings it implies."""
    f = "FSDPStrategy."
    strategy = str(keys.get(f + "sharding_strategy")).upper()
    mesh = keys.get(f + "device_mesh")
    wrap = keys.get(f + "auto_wrap_policy")
    classes = sorted(str(c) for c in wrap) if wrap else []
    if "HYBRID" in strategy and mesh is None and not classes:
        raise keys.located.error(f"{strategy} needs auto_wrap_policy or device_mesh (Lightning and FSDP raise)",
                                 key=f + "sharding_strategy", fix="pass device_mesh=(replicas, shard_size)")
    dtype, mixed = _trainer_precision(keys)
    given_mp = keys.get(f + "mixed_precision")
    if given_mp is not None:
        mp = {k: given_mp.get(k) for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}
    elif dtype != DType.FP32:
        mp = dict.fromkeys(("param_dtype", "reduce_dtype", "buffer_dtype"), _TORCH[dtype])
    else:
        mp = None
    loop: dict[str, Any] = {"gradient_accumulation_steps": keys.get("Trainer.accumulate_grad_batches"),
                            "clip_grad_norm": keys.get("Trainer.gradient_clip_val"),
                            "activation_checkpointing": bool(keys.get(f + "activation_checkpointing_policy")),
                            "master_dtype": "float32" if mixed else _TORCH[dtype]}
    if dtype == DType.FP16 and mixed:
        loop["loss_scaler"], loop["skip_nonfinite_steps"] = {}, True
    sdt = keys.get(f + "state_dict_type") if keys.given(f + "state_dict_type") else "sharded" if fabric else "full"
    kwargs: dict[str, Any] = {
        "sharding_strategy": strategy, "cpu_offload": {"offload_params": bool(keys.get(f + "cpu_offload"))},
        "device_mesh": {"shape": [int(n) for n in mesh]} if mesh is not None else None,
        "auto_wrap_policy": {"transformer_layer_cls": classes} if classes else None,
        "use_orig_params": keys.get(f + "use_orig_params"), "mixed_precision": mp,
        "state_dict_type": "SHARDED_STATE_DICT" if sdt == "sharded" else "FULL_STATE_DICT", "training_loop": loop}
    for name in ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "sync_module_states"):
        if keys.given(f + name):
            kwargs[name] = keys.values[f + name]
    for path in [p for p in keys.table.rows if p.path.startswith(f) or p.path.startswith("Trainer.")]:
        keys.note(path.path)
    return kwargs


# ---------------------------------------------------------------------------------------------- writing

def write_lightning(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """The registry name closest to ``spec``, the constructor arguments that make it exact, and the
    Trainer arguments it needs; what no argument can say is reported."""
    report = Report(source="spec", target=FORMAT)
    trainer = _trainer_args(spec, report)
    candidates: list[tuple[str, dict[str, Any]]]
    if spec.sharding.stage == 0:
        candidates = [("ddp", {})]
    else:
        candidates = [_deepspeed_candidate(spec), _fsdp_candidate(spec)]
    prefer_ds = spec.wrapping.policy == "every_module" or spec.sharding.stage in (1, 2)
    scored = []
    for name, kwargs in candidates:
        back = read_lightning(name, **kwargs, **trainer).value
        diffs = [d for d in spec_diff(spec, back) if d[0] != "precision.compute_copy"]  # reported below
        is_ds = name.startswith("deepspeed")
        scored.append((len(diffs), is_ds != prefer_ds, name, kwargs, diffs))
    _, _, name, kwargs, diffs = min(scored, key=lambda s: (s[0], s[1]))
    cls = _registry()[name]["class"]
    bare = _registry()[name]["kwargs"]
    for key, value in kwargs.items():
        report.add(f"kwargs.{key}", Status.EXACT, f"{value!r}; the bare name gives {_default(cls, bare, key)!r}",
                   target=f"{cls}.{key}")
    hint = _DS_HINT if cls == "DeepSpeedStrategy" else "no FSDPStrategy argument says it"
    write_compute_copy(report, spec.precision, "deepspeed" if cls == "DeepSpeedStrategy" else "fsdp"
                       if cls == "FSDPStrategy" else "autocast", target="Trainer.precision")
    no_compile_form(spec, report, "no Lightning strategy or Trainer argument compiles: pass torch.compile(model) "
                                  "to trainer.fit")
    for path, want, got in diffs:
        if path.startswith("compile."):
            continue
        report.add(path, Status.NOT_EXPRESSIBLE, f"{want!r} has no form here; {name} gives {got!r}; {hint}")
    report_carried(spec, report, own=FORMAT, target="a Lightning strategy", trainer=False,
                   elsewhere=f"{_DS_HINT}, which keeps it" if cls == "DeepSpeedStrategy" else "")
    value = {"strategy": name, "class": cls, "kwargs": kwargs, "trainer": trainer}
    return Translation(value, report)


def _default(cls: str, bare: dict[str, Any], key: str) -> Any:
    if key in bare:
        return bare[key]
    row = load_table(FORMAT).find(f"{cls}.{key}") or load_table(FORMAT).find(f"Trainer.{key}")
    return row.default if row is not None and row.has_default else None


def _trainer_args(spec: StrategySpec, report: Report) -> dict[str, Any]:
    p, b = spec.precision, spec.batch
    out: dict[str, Any] = {}
    if is_auto(p.param_dtype):
        report.add("precision.param_dtype", Status.AUTO, "left to Trainer(precision=...)", target="Trainer.precision")
    elif p.param_dtype != DType.FP32:
        kind = "mixed" if p.master_dtype == DType.FP32 else "true"
        out["precision"] = f"{'16' if p.param_dtype == DType.FP16 else 'bf16'}-{kind}"
    else:
        out["precision"] = "32-true"  # stated: a name read without precision leaves it to the script
    if not isinstance(b.accumulation_steps, int):
        report.add("batch.accumulation_steps", Status.AUTO, "left to Trainer(accumulate_grad_batches=...)")
    else:
        out["accumulate_grad_batches"] = b.accumulation_steps
    if is_auto(b.clip_grad_norm):
        report.add("batch.clip_grad_norm", Status.AUTO, "left to Trainer(gradient_clip_val=...)")
    else:
        out["gradient_clip_val"] = b.clip_grad_norm or 0.0
    return out


def _deepspeed_candidate(spec: StrategySpec) -> tuple[str, dict[str, Any]]:
    s, o, c, p = spec.sharding, spec.offload, spec.communication, spec.precision
    opt, par = o.optimizer, o.parameters
    name = f"deepspeed_stage_{s.stage.value}"
    if s.stage == 2 and opt.enabled:
        name += "_offload"
    elif s.stage == 3 and opt.enabled and par.enabled:
        name += "_offload_nvme" if opt.device.value == par.device.value == "nvme" else "_offload"
    want: dict[str, Any] = {
        "offload_optimizer": opt.enabled, "offload_parameters": par.enabled,
        "sub_group_size": o.sub_group_size, "overlap_comm": c.overlap_reduce,
        "optimizer_buffer_count": opt.buffer_count, "params_buffer_count": par.buffer_count,
        "params_buffer_size": par.buffer_size, "max_in_cpu": par.max_in_cpu,
        "pin_memory": opt.pin_memory if opt.enabled else par.pin_memory if par.enabled else False}
    if opt.enabled:
        want["offload_optimizer_device"] = opt.device.value
    if par.enabled:
        want["offload_params_device"] = par.device.value
    if opt.nvme_path or par.nvme_path:
        want["nvme_path"] = opt.nvme_path or par.nvme_path
    for arg, value in (("allgather_bucket_size", c.allgather_bucket), ("reduce_bucket_size", c.reduce_bucket)):
        if isinstance(value, int):
            want[arg] = value
    scale = p.loss_scaling
    if scale.kind == "static":
        want["loss_scale"] = scale.scale
    elif scale.kind == "dynamic":
        want.update(loss_scale=0, initial_scale_power=round(math.log2(scale.initial_scale)),
                    loss_scale_window=scale.growth_interval, hysteresis=scale.hysteresis,
                    min_loss_scale=scale.min_scale)
    bare = _registry()[name]["kwargs"]
    return name, {k: v for k, v in want.items() if _default("DeepSpeedStrategy", bare, k) != v}


def _fsdp_candidate(spec: StrategySpec) -> tuple[str, dict[str, Any]]:
    s, p, c, w = spec.sharding, spec.precision, spec.communication, spec.wrapping
    name = "fsdp_cpu_offload" if spec.offload.parameters.enabled else "fsdp"
    after_forward = s.parameters.value == "reshard_after_forward"
    want: dict[str, Any] = {"sharding_strategy": "FULL_SHARD" if after_forward else "SHARD_GRAD_OP",
                            "state_dict_type": "sharded" if spec.checkpoint.format == "sharded" else "full",
                            "backward_prefetch": {"before_grad": "BACKWARD_PRE", "after_grad": "BACKWARD_POST"}
                            .get(c.backward_prefetch.value), "forward_prefetch": c.forward_prefetch,
                            "limit_all_gathers": c.max_inflight_gathers is not None}
    if s.is_hybrid and isinstance(s.shard_group, int) and s.world_size:
        want["sharding_strategy"] = "HYBRID_SHARD" if after_forward else "_HYBRID_SHARD_ZERO2"
        want["device_mesh"] = (s.world_size // s.shard_group, s.shard_group)
    classes = getattr(w, "layer_classes", "auto")
    if w.policy == "transformer" and not is_auto(classes):
        want["auto_wrap_policy"] = list(classes)
        if spec.checkpoint.activation_checkpointing:
            want["activation_checkpointing_policy"] = list(classes)
    param, reduce = p.param_dtype, p.reduce_dtype
    if isinstance(param, DType) and isinstance(reduce, DType) and param != DType.FP32 \
            and (reduce, p.buffer_dtype) != (param, param):
        want["mixed_precision"] = {"param_dtype": _TORCH[param], "reduce_dtype": _TORCH[reduce],
                                   "buffer_dtype": _TORCH[p.buffer_dtype] if p.buffer_dtype else None}
    bare = _registry()[name]["kwargs"]
    return name, {k: v for k, v in want.items() if _default("FSDPStrategy", bare, k) != v}
