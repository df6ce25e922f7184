"""PyTorch FSDP1 (``FullyShardedDataParallel``) to and from the spec.

    >>> from zerobridge.translate.sources import parse_json
    >>> from zerobridge.translate.fsdp1 import read_fsdp1, write_fsdp1
    >>> spec = read_fsdp1(parse_json('{"sharding_strategy": "SHARD_GRAD_OP"}', "fsdp.json")).value
    >>> spec.summary()
    'stage 3, params reshard_after_backward, compute fp32'
    >>> write_fsdp1(spec).value["sharding_strategy"]
    'SHARD_GRAD_OP'

The JSON form is FSDP1's constructor keywords under torch's names plus
``training_loop`` (mappings/fsdp1.toml lists every key). Reading states every
spec field from FSDP1's effective behaviour; writing reports each spec setting
FSDP1 cannot state. ``read_fsdp1(write_fsdp1(s))`` gives back ``s`` for every
``s`` read from this format. ``zerobridge.backends.fsdp.kwargs.to_fsdp1_kwargs``
builds the live torch objects.
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import (
    BackwardPrefetch,
    CheckpointFormat,
    CheckpointSpec,
    CommunicationSpec,
    DType,
    GradSync,
    OffloadDevice,
    OffloadSpec,
    OptimizerOffload,
    ParamOffload,
    ParamSharding,
    PrecisionSpec,
    RootWrap,
    ShardingSpec,
    StrategySpec,
)
from zerobridge.translate.carried import report_carried
from zerobridge.translate.compilation import no_compile_form
from zerobridge.translate.compute_copy import read_compute_copy
from zerobridge.translate.fsdp_common import (
    PER_UNIT,
    TrainingLoopForm,
    accumulate_dtype_for,
    check_precision,
    choice,
    read_keys,
    read_mesh,
    read_training_loop,
    read_wrap,
    section,
    take,
)
from zerobridge.translate.fsdp_write import (
    StagePlan,
    checkpoint_format,
    mesh_form,
    report_fixed_behaviour,
    resolve_precision,
    stage_plan,
    write_offload,
    write_training_loop,
    write_wrap,
)
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located
from zerobridge.translate.values import name_in_torch
from zerobridge.translate.wire import report_no_wire_form

__all__ = ["read_fsdp1", "write_fsdp1"]

FMT = "fsdp1"
HYBRID = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}
STRATEGY_ALIASES = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "_HYBRID_SHARD_ZERO2", "hybrid_shard_zero2": "_HYBRID_SHARD_ZERO2"}
PREFETCH = {"BACKWARD_PRE": BackwardPrefetch.BEFORE_GRAD, "BACKWARD_POST": BackwardPrefetch.AFTER_GRAD,
            None: BackwardPrefetch.NONE}
STATE_DICT = {"FULL_STATE_DICT": CheckpointFormat.FULL, "SHARDED_STATE_DICT": CheckpointFormat.SHARDED,
              "LOCAL_STATE_DICT": CheckpointFormat.SHARDED}
STATE_DICT_ALIASES = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT",
                      "full": "FULL_STATE_DICT", "sharded": "SHARDED_STATE_DICT", "local": "LOCAL_STATE_DICT"}
CARRIED_FLAGS = ("use_orig_params", "sync_module_states")
ORDER = ("sharding_strategy", "cpu_offload", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
         "use_orig_params", "sync_module_states", "param_init_fn", "ignored_modules", "mixed_precision",
         "auto_wrap_policy", "device_mesh", "state_dict_type", "training_loop")
MP_CARRIED = ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs")


def read_fsdp1(located: Located) -> Translation[StrategySpec]:
    """The spec of an FSDP1 JSON form; unknown keys and bad values are ``ConfigError``."""
    report = Report(source=FMT, target="spec")
    r = read_keys(located, FMT, report)
    sharding = _read_sharding(r)
    offload = OffloadSpec()
    if section(r, "cpu_offload") is not None and take(r, "cpu_offload.offload_params"):
        if sharding.parameters.sharded_at_rest:
            offload = OffloadSpec(optimizer=OptimizerOffload(device=OffloadDevice.CPU, pin_memory=True),
                                  parameters=ParamOffload(device=OffloadDevice.CPU, pin_memory=True))
            r.mark("cpu_offload.offload_params", Status.EXACT, "both offload tiers on the host; FSDP1 always pins "
                   "the host copies (pin_memory true)")
        else:
            r.mark("cpu_offload.offload_params", Status.NOT_EXPRESSIBLE, "nothing is sharded, and the spec offloads "
                   "parameters only when they are sharded at rest (as DeepSpeed does): dropped")
    prefetch = choice(r, "backward_prefetch", aliases={"1": "BACKWARD_PRE", "2": "BACKWARD_POST", "none": None,
                                                      "no_prefetch": None}, nullable=True)
    communication = CommunicationSpec(
        reduce_bucket=PER_UNIT, allgather_bucket=PER_UNIT, prefetch_bucket=PER_UNIT, overlap_reduce=True,
        forward_prefetch=take(r, "forward_prefetch"), backward_prefetch=PREFETCH[prefetch],
        max_inflight_gathers=2 if take(r, "limit_all_gathers") else None, max_live_parameters=None,
        max_reuse_distance=None, persistence_threshold=0, model_persistence_threshold=None)
    report.add("communication", Status.DEFAULT, "fixed by FSDP: one collective per wrap unit (buckets "
               "\"per_unit\"), reduction overlapped with backward, no persistence threshold or live-parameter bound")
    for key in CARRIED_FLAGS:
        r.carry(key, take(r, key), False)
    for key in ("param_init_fn", "ignored_modules"):
        r.carry(key, take(r, key))
    loop = read_training_loop(r)
    precision = _read_precision(r, loop)
    wrapping = read_wrap(r, "auto_wrap_policy")
    state_dict = choice(r, "state_dict_type", aliases=STATE_DICT_ALIASES)
    assert state_dict is not None
    if state_dict == "LOCAL_STATE_DICT":
        r.mark("state_dict_type", Status.APPROXIMATED, "LOCAL_STATE_DICT (flat per-rank shards, reloadable only "
               "with the same wrapping and world size) reads as sharded and is written back as SHARDED_STATE_DICT")
    spec = StrategySpec(
        sharding=sharding, offload=offload, precision=precision, communication=communication, wrapping=wrapping,
        batch=loop.batch, checkpoint=CheckpointSpec(format=STATE_DICT[state_dict],
                                                    activation_checkpointing=loop.activation_checkpointing),
        passthrough={FMT: r.carried} if r.carried else {})
    return Translation(spec, report)


def _read_sharding(r: SourceKeys) -> ShardingSpec:
    strategy = choice(r, "sharding_strategy", aliases=STRATEGY_ALIASES)
    assert strategy is not None
    shape = read_mesh(r, "device_mesh")
    hybrid = strategy in HYBRID
    if shape is not None and len(shape) != (2 if hybrid else 1):
        raise r.error("device_mesh.shape", f"{strategy} takes a {'2' if hybrid else '1'}-D mesh, got {list(shape)}",
                      fix="[replicas, shard_size] for the hybrid strategies, [world] for the others")
    world = None if shape is None else shape[0] * (shape[1] if hybrid else 1)
    if strategy == "NO_SHARD":
        r.mark("sharding_strategy", Status.EXACT, "stage 0: gradients all-reduced, nothing sharded. torch "
               "deprecates NO_SHARD (FutureWarning) in favour of DistributedDataParallel")
        return ShardingSpec.for_stage(0, world_size=world)
    parameters = (ParamSharding.RESHARD_AFTER_FORWARD if HYBRID.get(strategy, strategy) == "FULL_SHARD"
                  else ParamSharding.RESHARD_AFTER_BACKWARD)
    r.mark("sharding_strategy", Status.EXACT, "ZeRO-3: parameters freed after forward and gathered again for "
           "backward" if parameters is ParamSharding.RESHARD_AFTER_FORWARD else "parameters sharded between steps, "
           "gathered once per step and kept until the end of backward (ZeRO-2 keeps them full)")
    if not hybrid:
        return ShardingSpec.for_stage(3, parameters=parameters, world_size=world)
    if shape is None:
        r.mark("sharding_strategy", Status.EXACT, "shard inside each node, replicate across nodes (shard_group "
               "\"node\"). On CPU-only hosts FSDP1 then shards over one rank and every rank trains alone: give a "
               "device_mesh there")
        return ShardingSpec.for_stage(3, parameters=parameters, shard_group="node")
    if shape[1] == 1:
        r.mark("device_mesh.shape", Status.EQUIVALENT, "a shard size of 1 shards nothing: stage 0 over "
               f"{shape[0]} replicas, written back as NO_SHARD over a 1-D mesh")
        r.carried.pop("device_mesh.mesh_dim_names", None)
        return ShardingSpec.for_stage(0, world_size=world)
    r.mark("device_mesh.shape", Status.EXACT, f"shard inside groups of {shape[1]}, replicate across {shape[0]}")
    return ShardingSpec.for_stage(3, parameters=parameters, shard_group=shape[1], world_size=world)


def _read_precision(r: SourceKeys, loop: TrainingLoopForm) -> PrecisionSpec:
    master = loop.master_dtype
    param, reduce, buffer = master, None, None
    if section(r, "mixed_precision") is not None:
        param = take(r, "mixed_precision.param_dtype") or master
        reduce = take(r, "mixed_precision.reduce_dtype")
        buffer = take(r, "mixed_precision.buffer_dtype")
        for key in MP_CARRIED:
            path = f"mixed_precision.{key}"
            r.carry(path, take(r, path), r.table.row(path).default)
    else:
        r.mark("mixed_precision", Status.DEFAULT if not r.given("mixed_precision") else Status.EXACT,
               f"no mixed precision: compute, reduction and gradients in the loaded dtype, {master.value} "
               "(training_loop.master_dtype)")
    check_precision(r, "mixed_precision.param_dtype", param, master, loop.loss_scaling)
    accumulate = accumulate_dtype_for(loop.batch.grad_sync, master=master, unsharded=param)
    r.report.add("training_loop.grad_sync", Status.EXACT, f"gradients accumulate in {accumulate.value}: reduced "
                 "shards in the loaded dtype, unsharded gradients inside no_sync() in param_dtype",
                 target="precision.accumulate_dtype")
    return read_compute_copy(r.report, PrecisionSpec(
        param_dtype=param, master_dtype=master, reduce_dtype=reduce or param, accumulate_dtype=accumulate,
        buffer_dtype=buffer, loss_scaling=loop.loss_scaling, skip_nonfinite_steps=loop.skip_nonfinite_steps),
        "fsdp", key="mixed_precision.param_dtype")


def write_fsdp1(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """The FSDP1 JSON form of ``spec``, every key explicit, with a report of
    what FSDP1 cannot state."""
    report = Report(source="spec", target=FMT)
    out: dict[str, Any] = {}
    plan = stage_plan(spec, report, target="sharding_strategy")
    out["sharding_strategy"], out["device_mesh"] = _write_sharding(spec, report, plan)
    offload, pinned = write_offload(spec, report, plan, target="cpu_offload")
    out["cpu_offload"] = {"offload_params": True} if offload else None
    if offload and not pinned:
        report.add("offload.parameters.pin_memory", Status.APPROXIMATED, "FSDP1 always pins the host copies",
                   target="cpu_offload")
    c = spec.communication
    out["backward_prefetch"] = {v: k for k, v in PREFETCH.items()}[c.backward_prefetch]
    out["forward_prefetch"] = c.forward_prefetch
    out["limit_all_gathers"] = c.max_inflight_gathers is not None
    if c.max_inflight_gathers not in (None, 2):
        report.add("communication.max_inflight_gathers", Status.APPROXIMATED, "FSDP1's limiter allows exactly two "
                   f"units' all-gathers in flight, not {c.max_inflight_gathers}", target="limit_all_gathers")
    report_fixed_behaviour(spec, report)
    no_compile_form(spec, report, "FullyShardedDataParallel takes no compile argument: call torch.compile on the "
                                  "wrapped model in the script (needs use_orig_params=True)")
    carried = spec.passthrough.get(FMT, {})
    for key in CARRIED_FLAGS:
        out[key] = carried.get(key, False)
    for key in ("param_init_fn", "ignored_modules"):
        if carried.get(key) is not None:
            out[key] = carried[key]
    param, reduce, master = resolve_precision(spec, report, target="mixed_precision")
    out["mixed_precision"] = _write_mixed_precision(spec, report, param, reduce, master, plan.force_no_sync)
    out["auto_wrap_policy"] = write_wrap(spec, report, target="auto_wrap_policy")
    fmt = checkpoint_format(spec, report, target="state_dict_type")
    out["state_dict_type"] = "FULL_STATE_DICT" if fmt is CheckpointFormat.FULL else "SHARDED_STATE_DICT"
    out["training_loop"] = write_training_loop(spec, report, param=param, force_no_sync=plan.force_no_sync,
                                               clip_api="FSDP.clip_grad_norm_")
    accumulating = spec.batch.accumulation_steps != 1
    if offload and accumulating and out["training_loop"]["grad_sync"] == "every_micro_step":
        report.add("batch.grad_sync", Status.APPROXIMATED, "FSDP1 cannot accumulate gradients outside no_sync() "
                   "while offloading to the host: use grad_sync no_sync", target="training_loop.grad_sync")
    if isinstance(spec.wrapping, RootWrap) and out["sharding_strategy"] in HYBRID and out["device_mesh"] is None:
        report.add("wrapping", Status.APPROXIMATED, "FSDP1 rejects a hybrid strategy with neither an "
                   "auto_wrap_policy nor a device_mesh: give one", target="auto_wrap_policy")
    report_no_wire_form(spec, report, "FSDP1 kwargs", {})
    report_carried(spec, report, own=FMT, target="FSDP1 kwargs", trainer=True)
    return Translation({key: out[key] for key in ORDER if key in out}, report)


def _write_sharding(spec: StrategySpec, report: Report, plan: StagePlan) -> tuple[str, dict[str, Any] | None]:
    s, world = spec.sharding, spec.sharding.world_size
    flat = mesh_form([world], spec, FMT, "device_mesh.mesh_dim_names") if world else None
    if s.backward_gather_group is not None:
        report.add("sharding.backward_gather_group", Status.NOT_EXPRESSIBLE, "FSDP1 has no secondary shard "
                   "(ZeRO++ hpZ): backward all-gathers span the whole shard group (FSDP2 has it)",
                   target="sharding_strategy")
    if not plan.sharded:
        report.add("sharding", Status.EXACT, "stage 0 is NO_SHARD, which torch deprecates (FutureWarning) in "
                   "favour of DistributedDataParallel", target="sharding_strategy")
        if s.stage == 0 and s.shard_group != "world":
            report.add("sharding.shard_group", Status.IGNORED, "nothing is sharded at stage 0",
                       target="sharding_strategy")
        return "NO_SHARD", flat
    strategy = "FULL_SHARD" if plan.reshard_after_forward else "SHARD_GRAD_OP"
    if s.shard_group == "world":
        return strategy, flat
    hybrid = {v: k for k, v in HYBRID.items()}[strategy]
    if s.shard_group == "node":
        report.add("sharding.shard_group", Status.EXACT, "without a device_mesh FSDP1 shards inside each node. On "
                   "CPU-only hosts that group is one rank and every rank trains alone", target="sharding_strategy")
        return hybrid, None
    k = int(s.shard_group)
    if world is None:
        report.add("sharding.shard_group", Status.APPROXIMATED, f"a shard group of {k} ranks needs the 2-D "
                   "device_mesh [world/k, k], and the world size is unknown: FSDP1 shards inside each node "
                   "instead (wrong on CPU-only hosts, where that group is one rank)", target="device_mesh")
        return hybrid, None
    report.add("sharding.shard_group", Status.EXACT, f"shard inside groups of {k}, replicate across "
               f"{world // k}", target="device_mesh")
    return hybrid, mesh_form([world // k, k], spec, FMT, "device_mesh.mesh_dim_names")


def _write_mixed_precision(spec: StrategySpec, report: Report, param: DType, reduce: DType, master: DType,
                           force_no_sync: bool) -> dict[str, Any] | None:
    p = spec.precision
    sync = GradSync.ACCUMULATION_BOUNDARY if force_no_sync else spec.batch.grad_sync
    accumulate = accumulate_dtype_for(sync, master=master, unsharded=param)
    if p.accumulate_dtype not in ("auto", accumulate):
        report.add("precision.accumulate_dtype", Status.APPROXIMATED, f"FSDP1 accumulates gradients in "
                   f"{accumulate.value}: reduced shards in the loaded dtype, unsharded gradients inside no_sync() "
                   f"in param_dtype (the spec says {p.accumulate_dtype})", target="mixed_precision")
    if p.reduce_dtype != param:
        report.add("precision.reduce_dtype", Status.EXACT, f"reduced in {reduce.value} (DeepSpeed's and torch's "
                   "default is the compute dtype)", target="mixed_precision.reduce_dtype")
    carried = {k: spec.passthrough.get(FMT, {}).get(f"mixed_precision.{k}") for k in MP_CARRIED}
    if param == master and reduce == master and p.buffer_dtype is None and not any(
            v is not None for v in carried.values()):
        return None
    defaults = {"keep_low_precision_grads": False, "cast_forward_inputs": False, "cast_root_forward_inputs": True}
    return {"param_dtype": name_in_torch(param), "reduce_dtype": name_in_torch(reduce),
            "buffer_dtype": name_in_torch(p.buffer_dtype) if p.buffer_dtype else None,
            **{k: defaults[k] if v is None else v for k, v in carried.items()}}
