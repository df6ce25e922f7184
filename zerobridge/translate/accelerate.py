"""HF Accelerate config YAML -> spec, read the way ``accelerate launch`` reads it.

    >>> from zerobridge.translate.sources import parse_yaml
    >>> from zerobridge.translate.accelerate import read_accelerate
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
The writers are in ``accelerate_emit``; ``SourceKeys`` (the key reader every
translator shares) and the other shared helpers are in ``keys``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import AUTO, DType, Stage, StrategySpec, is_auto
from zerobridge.translate.keys import FALSY, TRUTHY, SourceKeys, chain_report, update_spec
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located, parse_json, read_text

__all__ = ["read_accelerate"]

FORMAT = "accelerate"
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""Accelerate's FSDP1 strategy names; the YAML may also give their positions 1-5."""
_RESHARDS = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD_ZERO2": False,
             "NO_SHARD": False}
_MIXED = {"fp16": DType.FP16, "bf16": DType.BF16, "fp8": DType.BF16}
_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                   "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                   "zero3_save_16bit_model")
"""Inline keys Accelerate refuses next to a deepspeed_config_file (with a top-level mixed_precision)."""
_SECTIONS = {"FSDP": "fsdp_config", "DEEPSPEED": "deepspeed_config"}
GRAD_SCALER = {"kind": "dynamic", "initial_scale": 2.0**16, "growth_interval": 2000, "growth_factor": 2.0,
               "backoff_factor": 0.5, "hysteresis": 1, "consecutive_hysteresis": False, "min_scale": 0.0}
"""torch's GradScaler defaults, which Accelerate uses for fp16 outside DeepSpeed."""

F = "fsdp_config."
P = "parallelism_config.parallelism_config_"
D = "deepspeed_config."


def _fsdp_prefix(prefix: str, key: str) -> str:
    # The launcher copies fsdp_config keys to --fsdp_* arguments, adding the prefix when missing.
    return key if prefix != "fsdp_config" or key.startswith("fsdp_") else f"fsdp_{key}"


def _call(located: Located, reader: Callable[[Located], Translation[StrategySpec]], data: dict[str, Any],
          label: str, key: str) -> Translation[StrategySpec]:
    """Run a delegate reader on built kwargs; its errors point at the YAML key they came from."""
    try:
        return reader(Located(data, f"{located.source} ({label})"))
    except ConfigError as exc:
        raise located.error(f"{exc.message} (in the {label} Accelerate builds from it)", key=key,
                            fix=exc.fix) from None


# ---------------------------------------------------------------------------------------------- reading

def read_accelerate(located: Located, *, base_dir: Path | None = None) -> Translation[StrategySpec]:
    """The spec an Accelerate config YAML means, and a key-by-key report.

    ``base_dir``: where a relative ``deepspeed_config_file`` is looked up (the
    directory ``accelerate launch`` runs in); default: the YAML's directory.
    """
    report = Report(source=FORMAT, target="spec")
    keys = SourceKeys(located, load_table(FORMAT), report, consumer="Accelerate", bools="accelerate",
                      normalize=_fsdp_prefix)
    if not keys.given("distributed_type"):
        raise located.error("no distributed_type: Accelerate refuses a config without one",
                            fix="add distributed_type: FSDP, DEEPSPEED or MULTI_GPU")
    kind = keys.get("distributed_type")
    keys.note("distributed_type")
    mixed = _mixed_precision(keys)
    world = keys.get("num_processes")
    world = world if isinstance(world, int) and world > 0 else None
    if kind == "FSDP":
        spec = _read_fsdp(keys, mixed, world)
    elif kind == "DEEPSPEED":
        spec = _read_deepspeed(keys, mixed, world, base_dir)
    elif kind in ("XLA", "MEGATRON_LM"):
        raise located.error(f"distributed_type {kind} is neither ZeRO nor FSDP data parallelism",
                            key=keys.key("distributed_type"), fix="use FSDP, DEEPSPEED or a MULTI_* type")
    else:
        spec = _read_ddp(keys, kind, mixed, world)
    for section in ("fsdp_config", "deepspeed_config"):
        if _SECTIONS.get(kind) != section:
            for path in [p for p in keys.values if p.startswith(section + ".")]:
                keys.note(path, Status.IGNORED, f"distributed_type is {kind}: Accelerate does not read {section}")
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


def _carry_machines(keys: SourceKeys, why: str) -> None:
    keys.note("num_machines", Status.NOT_ABOUT_SHARDING, why)
    if keys.given("num_machines"):
        keys.carried["num_machines"] = keys.values["num_machines"]


def _read_ddp(keys: SourceKeys, kind: str, mixed: str, world: int | None) -> StrategySpec:
    compute = _MIXED.get(mixed, DType.FP32)
    _carry_machines(keys, "DDP replicates over every process of every machine")
    keys.report.add("distributed_type", Status.EQUIVALENT, f"{kind} is DDP: ZeRO stage 0, gradients all-reduced "
                    f"in fp32 under autocast{', with a GradScaler' if mixed == 'fp16' else ''}", target="sharding")
    return StrategySpec.model_validate({
        "sharding": {"world_size": 1 if kind == "NO" else world},
        "precision": {"param_dtype": compute, "master_dtype": DType.FP32, "reduce_dtype": DType.FP32,
                      "accumulate_dtype": DType.FP32, **_scaling(mixed)},
        "batch": {"grad_sync": "accumulation_boundary"}, "checkpoint": {"format": "full"}})


# FSDP -------------------------------------------------------------------------------------------------

_FSDP_RENAMES = {
    "sharding_strategy": F + "fsdp_sharding_strategy", "reshard_after_forward": F + "fsdp_reshard_after_forward",
    "cpu_offload.": F + "fsdp_offload_params", "offload_policy.": F + "fsdp_offload_params",
    "cpu_offload": F + "fsdp_offload_params", "offload_policy": F + "fsdp_offload_params",
    "backward_prefetch": F + "fsdp_backward_prefetch", "forward_prefetch": F + "fsdp_forward_prefetch",
    "mixed_precision": "mixed_precision", "mixed_precision.": "mixed_precision", "mp_policy": "mixed_precision",
    "mp_policy.": "mixed_precision", "auto_wrap_policy": F + "fsdp_auto_wrap_policy",
    "auto_wrap_policy.": F + "fsdp_auto_wrap_policy", "wrap": F + "fsdp_auto_wrap_policy",
    "wrap.": F + "fsdp_auto_wrap_policy",
    "state_dict_type": F + "fsdp_state_dict_type", "training_loop.full_state_dict": F + "fsdp_state_dict_type",
    "training_loop.activation_checkpointing": F + "fsdp_activation_checkpointing",
    "use_orig_params": F + "fsdp_use_orig_params", "sync_module_states": F + "fsdp_sync_module_states",
}


def _read_fsdp(keys: SourceKeys, mixed: str, world: int | None) -> StrategySpec:
    from zerobridge.translate.fsdp import read_fsdp1, read_fsdp2
    version = keys.get(F + "fsdp_version")
    if version not in (1, 2):
        raise keys.located.error(f"expected 1 or 2, got {version!r}", key=keys.key(F + "fsdp_version"))
    keys.note(F + "fsdp_version")
    if keys.flag(F + "fsdp_cpu_ram_efficient_loading", "true") and not keys.flag(F + "fsdp_sync_module_states", "true"):
        raise keys.located.error("fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states (the launcher raises)",
                                 key=keys.key(F + "fsdp_sync_module_states"), fix="set fsdp_sync_module_states: true")
    name = {"fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}.get(mixed)
    offload = keys.get(F + "fsdp_offload_params")
    keys.note(F + "fsdp_offload_params")
    wrap = _wrap(keys)
    sdt = _state_dict_type(keys, version)
    loop: dict[str, Any] = {"activation_checkpointing": keys.get(F + "fsdp_activation_checkpointing"),
                            "master_dtype": "float32", "grad_sync": "no_sync"}
    keys.note(F + "fsdp_activation_checkpointing")
    if mixed == "fp16":
        loop["loss_scaler"] = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 2000}
        loop["skip_nonfinite_steps"] = True
    if version == 1:
        strategy = _fsdp1_strategy(keys)
        mesh = _hybrid_mesh(keys, strategy, wrap, world)
        prefetch = _prefetch(keys, 1)
        kwargs: dict[str, Any] = {
            "sharding_strategy": "_" + strategy if strategy == "HYBRID_SHARD_ZERO2" else strategy,
            "device_mesh": {"shape": mesh} if mesh else None, "cpu_offload": {"offload_params": offload},
            "backward_prefetch": prefetch, "forward_prefetch": keys.get(F + "fsdp_forward_prefetch"),
            "limit_all_gathers": True, "auto_wrap_policy": wrap, "state_dict_type": sdt,
            "mixed_precision": {"param_dtype": name, "reduce_dtype": name, "buffer_dtype": name} if name else None,
            "use_orig_params": keys.flag(F + "fsdp_use_orig_params", "true"),
            "sync_module_states": keys.flag(F + "fsdp_sync_module_states", "true"), "training_loop": loop}
        keys.note(F + "fsdp_forward_prefetch")
        t = _call(keys.located, read_fsdp1, kwargs, "FSDP1 kwargs", F + "fsdp_sharding_strategy")
        dp_world = world
    else:
        reshard = _fsdp2_reshard(keys)
        mesh, dp_world = _fsdp2_mesh(keys, world)
        _prefetch(keys, 2)
        if keys.given(F + "fsdp_forward_prefetch") and keys.get(F + "fsdp_forward_prefetch"):
            keys.note(F + "fsdp_forward_prefetch", Status.IGNORED, "FSDP2: Accelerate never reads it")
        kwargs = {"reshard_after_forward": reshard, "mesh": {"shape": mesh} if mesh else None,
                  "offload_policy": {"pin_memory": True} if offload else None,
                  "mp_policy": {"param_dtype": name, "reduce_dtype": name, "output_dtype": name} if name else None,
                  "wrap": wrap, "training_loop": {**loop, "full_state_dict": sdt == "FULL_STATE_DICT"}}
        t = _call(keys.located, read_fsdp2, kwargs, "FSDP2 kwargs", F + "fsdp_reshard_after_forward")
    chain_report(keys.report, t.report, _FSDP_RENAMES, f"FSDP{version} kwarg")
    return update_spec(t.value, {"sharding.world_size": dp_world}, source=keys.located.source)


def _strategy_meant(value: Any) -> str | None:
    text = str(value).upper()
    if text.isdigit() and 1 <= int(text) <= 5:
        return STRATEGIES[int(text) - 1]
    if text.lower() in TRUTHY + FALSY:
        return "FULL_SHARD" if text.lower() in TRUTHY else "SHARD_GRAD_OP"
    return text.removeprefix("_") if text.removeprefix("_") in STRATEGIES else None


def _fsdp1_strategy(keys: SourceKeys) -> str:
    path, raf = F + "fsdp_sharding_strategy", F + "fsdp_reshard_after_forward"
    strategy = _strategy_meant(keys.get(path)) or "FULL_SHARD"
    keys.note(path, extra="" if keys.given(path) else "the launcher exports FULL_SHARD")
    if keys.given(raf):
        value = keys.values[raf]
        meant = _strategy_meant(value)
        if str(value).lower() in TRUTHY + FALSY and not str(value).isdigit():  # FSDP2's form: compare the timing
            meant = strategy if _RESHARDS[strategy] == (str(value).lower() in TRUTHY) else meant
        if meant == strategy:
            keys.note(raf, Status.EQUIVALENT, f"agrees with fsdp_sharding_strategy ({strategy}), the key FSDP1 reads")
        else:
            keys.note(raf, Status.IGNORED, f"FSDP1 never reads it: the run uses {strategy} from "
                      f"fsdp_sharding_strategy, not {meant or keys.values[raf]!r}; set fsdp_sharding_strategy too")
    return strategy


def _fsdp2_reshard(keys: SourceKeys) -> bool:
    raf, path = F + "fsdp_reshard_after_forward", F + "fsdp_sharding_strategy"
    value = keys.values.get(raf, True)
    if str(value).lower() not in TRUTHY + FALSY:
        meant = _strategy_meant(value)
        fix = f"write {str(_RESHARDS[meant]).lower()} (what {meant} means)" if meant else "write true or false"
        raise keys.located.error(f"FSDP2 takes true or false here, got {value!r} (Accelerate raises)",
                                 key=keys.key(raf), fix=fix)
    reshard = str(value).lower() in TRUTHY
    keys.note(raf)
    if keys.given(path):
        strategy = _strategy_meant(keys.get(path)) or "FULL_SHARD"
        hybrid = strategy.startswith("HYBRID")
        agrees = _RESHARDS[strategy] == reshard and not hybrid and strategy != "NO_SHARD"
        keys.note(path, Status.EQUIVALENT if agrees else Status.IGNORED,
                  "FSDP2 ignores it and reads fsdp_reshard_after_forward"
                  + ("; hybrid sharding needs parallelism_config dp_replicate_size/dp_shard_size" if hybrid else ""))
    return reshard


def _wrap(keys: SourceKeys) -> dict[str, Any] | None:
    policy_key, cls_key, min_key = F + "fsdp_auto_wrap_policy", F + "fsdp_transformer_layer_cls_to_wrap", \
        F + "fsdp_min_num_params"
    policy = keys.get(policy_key)
    keys.note(policy_key)
    raw = keys.get(cls_key)
    classes = [c.strip() for c in str(raw).split(",") if c.strip()] if raw else []
    minimum = keys.get(min_key)
    if policy == "TRANSFORMER_BASED_WRAP":
        keys.note(cls_key) if classes else keys.report.add(
            cls_key, Status.DEFAULT, "absent: the model's _no_split_modules", target="wrapping.layer_classes")
        if keys.given(min_key):
            keys.note(min_key, Status.EXACT, "unused: the policy is TRANSFORMER_BASED_WRAP")
        return {"transformer_layer_cls": classes or "auto"}
    if keys.given(cls_key):
        keys.note(cls_key, Status.IGNORED, f"unused: fsdp_auto_wrap_policy is {policy}"
                  + (", so Accelerate wraps only the root" if policy == "NO_WRAP" else ""))
    if policy == "SIZE_BASED_WRAP":
        keys.note(min_key, extra="0 turns auto-wrapping off: one unit" if minimum == 0 else "")
        return {"min_num_params": minimum} if minimum > 0 else None
    if keys.given(min_key):
        keys.note(min_key, Status.EXACT, f"unused: the policy is {policy}")
    return None


def _state_dict_type(keys: SourceKeys, version: int) -> str:
    path = F + "fsdp_state_dict_type"
    sdt = keys.get(path) or ("FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT")
    sdt = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")[int(sdt) - 1] if sdt.isdigit() else sdt
    if version == 2 and sdt == "LOCAL_STATE_DICT":
        raise keys.located.error("FSDP2 has no LOCAL_STATE_DICT (Accelerate raises)", key=keys.key(path),
                                 fix="use SHARDED_STATE_DICT or FULL_STATE_DICT")
    keys.note(path) if keys.given(path) else keys.report.add(
        path, Status.DEFAULT, f"absent: {sdt}, Accelerate's FSDP{version} default", target="checkpoint.format")
    return sdt


def _prefetch(keys: SourceKeys, version: int) -> str | None:
    path, legacy = F + "fsdp_backward_prefetch", F + "fsdp_backward_prefetch_policy"
    if keys.given(legacy):
        keys.note(legacy)
    raw = keys.get(path)
    name = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")[int(raw) - 1] if raw.isdigit() else raw
    if version == 2:
        if keys.given(path):
            keys.note(path, Status.EQUIVALENT if name == "BACKWARD_PRE" else Status.IGNORED,
                      "FSDP2: Accelerate drops it; FSDP2 always prefetches before the gradient computation")
        return None
    keys.note(path, extra="" if keys.given(path) else "Accelerate's default, not torch's BACKWARD_PRE")
    return None if name == "NO_PREFETCH" else name


def _hybrid_mesh(keys: SourceKeys, strategy: str, wrap: Any, world: int | None) -> list[int] | None:
    if not strategy.startswith("HYBRID"):
        _carry_machines(keys, "FSDP shards over every process of every machine")
        return None
    if wrap is None:
        raise keys.located.error(f"{strategy} with no fsdp_auto_wrap_policy: FSDP refuses a hybrid strategy with "
                                 "manual wrapping when Accelerate passes no mesh",
                                 key=keys.key(F + "fsdp_sharding_strategy"),
                                 fix="set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP")
    machines = keys.get("num_machines")
    if world is None or machines < 1 or world % machines:
        keys.note("num_machines", Status.EQUIVALENT, "shard group: the ranks of one node (FSDP groups the local "
                  "devices); num_processes / num_machines is unknown here", target="sharding.shard_group")
        return None
    per = world // machines
    flat = "FULL_SHARD" if strategy == "HYBRID_SHARD" else "SHARD_GRAD_OP"
    keys.note("num_machines", Status.EXACT, f"shard group = {world} processes / {machines} machines = {per} ranks"
              + (f"; one machine: the group is the whole world, so {strategy} runs as {flat}" if machines == 1 else ""),
              target="sharding.shard_group")
    return [machines, per]


def _fsdp2_mesh(keys: SourceKeys, world: int | None) -> tuple[list[int] | None, int | None]:
    _carry_machines(keys, "FSDP2 takes hybrid groups from parallelism_config, not from machines")
    names = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
    if not any(keys.given(f"{P}{n}_size") for n in names):
        return None, world
    replicate, shard, tp, cp, sp = (keys.get(f"{P}{n}_size") for n in names)
    total, group, where = replicate * shard * tp * cp * sp, shard * cp, keys.key(f"{P}dp_shard_size")
    if world is not None and total != world and not (sp > 1 or total == 1):
        raise keys.located.error(f"parallelism sizes multiply to {total} but num_processes is {world} (Accelerate "
                                 "raises)", key=where,
                                 fix="make dp_replicate x dp_shard x tp x cp x sp = num_processes")
    if group == 1 and (total > 1 or (world or 1) > 1):
        raise keys.located.error("FSDP has no dimension to shard across: dp_shard_size and cp_size are both 1 "
                                 "(Accelerate raises)", key=where, fix="set parallelism_config_dp_shard_size > 1")
    for n, size in (("dp_replicate", replicate), ("dp_shard", shard)):
        keys.note(f"{P}{n}_size")
    for n, size in (("tp", tp), ("cp", cp), ("sp", sp)):
        if size > 1:
            keys.note(f"{P}{n}_size", extra=f"the spec describes the {replicate * group}-rank data-parallel mesh "
                      f"(dp_replicate {replicate} x dp_shard*cp {group}) of {total} processes")
        elif keys.given(f"{P}{n}_size"):
            keys.note(f"{P}{n}_size", Status.EXACT, "off")
    return ([replicate, group] if replicate > 1 else [group]), replicate * group


# DeepSpeed --------------------------------------------------------------------------------------------

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
    from zerobridge.translate.deepspeed import read_deepspeed
    loc, file_key = keys.located, D + "deepspeed_config_file"
    _carry_machines(keys, "ZeRO partitions over every process of every machine")
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
        spec = _inline_deepspeed(keys, mixed, moe, read_deepspeed)
    return update_spec(spec, {"sharding.world_size": world}, source=loc.source)


def _inline_deepspeed(keys: SourceKeys, mixed: str, moe: list[str], reader: Any) -> StrategySpec:
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
    t = _call(keys.located, reader, config, "DeepSpeed JSON", D + "zero_stage")
    chain_report(keys.report, t.report, _DS_RENAMES, "DeepSpeed JSON")
    return t.value
