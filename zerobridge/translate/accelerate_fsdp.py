"""Accelerate's FSDP plugin (``distributed_type: FSDP``) -> spec: the FSDP1 or
FSDP2 keyword arguments Accelerate builds from ``fsdp_config``, read by the
FSDP readers, plus what Accelerate adds (hybrid groups, its meshes, fp32
upcast). Called by ``accelerate_read.read_accelerate``.

    >>> from zerobridge.translate.sources import parse_yaml
    >>> from zerobridge.translate.accelerate_read import read_accelerate
    >>> yaml = "{distributed_type: FSDP, mixed_precision: bf16, fsdp_config: {fsdp_sharding_strategy: SHARD_GRAD_OP}}"
    >>> read_accelerate(parse_yaml(yaml, "a.yaml")).value.summary()
    'stage 3, params reshard_after_backward, compute bf16'
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import StrategySpec
from zerobridge.translate.accelerate_common import F, P, call_reader, carry_machines
from zerobridge.translate.fsdp1 import read_fsdp1
from zerobridge.translate.fsdp2 import read_fsdp2
from zerobridge.translate.keys import FALSY, TRUTHY, SourceKeys, chain_report, update_spec
from zerobridge.translate.report import Status

__all__ = ["read_fsdp_plugin"]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""Accelerate's FSDP1 strategy names; the YAML may also give their positions 1-5."""
_RESHARDS = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD_ZERO2": False,
             "NO_SHARD": False}

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


def read_fsdp_plugin(keys: SourceKeys, mixed: str, world: int | None) -> StrategySpec:
    """Accelerate's FSDP plugin (``fsdp_config``, FSDP1 or FSDP2) as a spec."""
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
        t = call_reader(keys.located, read_fsdp1, kwargs, "FSDP1 kwargs", F + "fsdp_sharding_strategy")
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
        t = call_reader(keys.located, read_fsdp2, kwargs, "FSDP2 kwargs", F + "fsdp_reshard_after_forward")
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
        carry_machines(keys, "FSDP shards over every process of every machine")
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
    carry_machines(keys, "FSDP2 takes hybrid groups from parallelism_config, not from machines")
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
    for n in ("dp_replicate", "dp_shard"):
        keys.note(f"{P}{n}_size")
    for n, size in (("tp", tp), ("cp", cp), ("sp", sp)):
        if size > 1:
            keys.note(f"{P}{n}_size", extra=f"the spec describes the {replicate * group}-rank data-parallel mesh "
                      f"(dp_replicate {replicate} x dp_shard*cp {group}) of {total} processes")
        elif keys.given(f"{P}{n}_size"):
            keys.note(f"{P}{n}_size", Status.EXACT, "off")
    return ([replicate, group] if replicate > 1 else [group]), replicate * group

