"""PyTorch FSDP2 (``fully_shard``) to and from the spec.

    >>> from zerobridge.translate.sources import parse_json
    >>> from zerobridge.translate.fsdp2 import read_fsdp2, write_fsdp2
    >>> spec = read_fsdp2(parse_json('{"reshard_after_forward": 8, "mesh": {"shape": [4, 32], '
    ...                              '"mesh_dim_names": ["dp_replicate", "dp_shard"]}}', "fsdp2.json")).value
    >>> spec.summary()
    'stage 3, params reshard_after_forward, shard group 32, backward gather group 8, compute fp32'
    >>> write_fsdp2(spec).value["reshard_after_forward"]
    8

The JSON form is ``fully_shard``'s keywords under torch's names, plus ``wrap``
(which submodules get their own ``fully_shard`` call) and ``training_loop``
(mappings/fsdp2.toml lists every key). ``read_fsdp2(write_fsdp2(s))`` gives
back ``s`` for every ``s`` read from this format. ``to_fsdp2_kwargs`` and
``fsdp2_units`` in ``zerobridge.backends.fsdp.kwargs`` build the live torch
objects and list the submodules to shard first.
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
    ShardingSpec,
    StrategySpec,
    WireFormat,
)
from zerobridge.translate.carried import report_carried
from zerobridge.translate.compilation import no_compile_form
from zerobridge.translate.compute_copy import read_compute_copy
from zerobridge.translate.fsdp_common import (
    PER_UNIT,
    TrainingLoopForm,
    accumulate_dtype_for,
    check_precision,
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
from zerobridge.translate.wire import TORCHAO_RECIPE, report_no_wire_form

__all__ = ["read_fsdp2", "write_fsdp2"]

FMT = "fsdp2"
NAMES_KEY = "mesh.mesh_dim_names"


def read_fsdp2(located: Located) -> Translation[StrategySpec]:
    """The spec of an FSDP2 JSON form; unknown keys and bad values are ``ConfigError``."""
    report = Report(source=FMT, target="spec")
    r = read_keys(located, FMT, report)
    sharding = _read_sharding(r)
    offload = OffloadSpec()
    if section(r, "offload_policy") is not None:
        pin = take(r, "offload_policy.pin_memory")
        if sharding.parameters.sharded_at_rest:
            tier = {"device": OffloadDevice.CPU, "pin_memory": pin}
            offload = OffloadSpec(optimizer=OptimizerOffload(**tier), parameters=ParamOffload(**tier))
            r.mark("offload_policy", Status.EXACT, "CPUOffloadPolicy: both offload tiers on the host")
        else:
            r.mark("offload_policy", Status.NOT_EXPRESSIBLE, "nothing is sharded, and the spec offloads parameters "
                   "only when they are sharded at rest (as DeepSpeed does): dropped")
    communication = CommunicationSpec(
        reduce_bucket=PER_UNIT, allgather_bucket=PER_UNIT, prefetch_bucket=PER_UNIT, overlap_reduce=True,
        forward_prefetch=False, backward_prefetch=BackwardPrefetch.BEFORE_GRAD, max_inflight_gathers=None,
        max_live_parameters=None, max_reuse_distance=None, persistence_threshold=0, model_persistence_threshold=None)
    report.add("communication", Status.DEFAULT, "fixed by FSDP2: one collective per fully_shard unit (buckets "
               "\"per_unit\"), reduction overlapped with backward, backward all-gathers prefetched before the "
               "gradient computation, no forward prefetch unless set_modules_to_forward_prefetch is called, no "
               "all-gather limit flag, no persistence threshold or live-parameter bound")
    for key in ("shard_placement_fn", "ignored_params"):
        r.carry(key, take(r, key))
    loop = read_training_loop(r)
    precision = _read_precision(r, loop)
    wrapping = read_wrap(r, "wrap")
    full = take(r, "training_loop.full_state_dict")
    spec = StrategySpec(
        sharding=sharding, offload=offload, precision=precision, communication=communication, wrapping=wrapping,
        batch=loop.batch,
        checkpoint=CheckpointSpec(format=CheckpointFormat.FULL if full else CheckpointFormat.SHARDED,
                                  activation_checkpointing=loop.activation_checkpointing),
        passthrough={FMT: r.carried} if r.carried else {})
    return Translation(spec, report)


def _read_sharding(r: SourceKeys) -> ShardingSpec:
    shape = read_mesh(r, "mesh")
    world = None if shape is None else shape[0] * (shape[1] if len(shape) == 2 else 1)
    shard = None if shape is None else shape[-1]
    key = "reshard_after_forward"
    value = take(r, key)
    gather: int | None = None
    if value is None:
        value = True
        r.mark(key, Status.EQUIVALENT, "null (torch's default) reshards every unit but the root, which keeps its "
               "parameters from forward to backward: read as true, written back as true")
    elif not isinstance(value, bool):
        if not isinstance(value, int) or value < 1:
            raise r.error(key, f"expected true, false, null or a positive rank count, got {value!r}")
        if shard is not None and shard % value:
            raise r.error(key, f"{value} does not divide the shard size {shard}",
                          fix=f"use a divisor of {shard}, true or false")
        if value == 1:
            value = False
            r.mark(key, Status.EQUIVALENT, "1 keeps full parameters after forward: torch treats it as false")
        elif value == shard:
            value = True
            r.mark(key, Status.EQUIVALENT, f"{shard}, the whole shard size, is what torch treats as true")
        else:
            gather, value = value, True
            r.mark(key, Status.EXACT, f"ZeRO++ hpZ: a secondary shard over {gather} ranks for backward")
    if shape is not None and len(shape) == 2 and shape[1] == 1:
        r.mark("mesh.shape", Status.EQUIVALENT, f"a shard size of 1 shards nothing: stage 0 over {shape[0]} "
               "replicas")
        return ShardingSpec.for_stage(0, world_size=world)
    parameters = ParamSharding.RESHARD_AFTER_FORWARD if value else ParamSharding.RESHARD_AFTER_BACKWARD
    group: int | str = shape[-1] if shape is not None and len(shape) == 2 else "world"
    return ShardingSpec.for_stage(3, parameters=parameters, shard_group=group, world_size=world,
                                  backward_gather_group=gather)


def _read_precision(r: SourceKeys, loop: TrainingLoopForm) -> PrecisionSpec:
    master = loop.master_dtype
    section(r, "mp_policy")
    param = take(r, "mp_policy.param_dtype") or master
    if r.values.get("mp_policy.param_dtype") is None:
        r.mark("mp_policy.param_dtype", Status.DEFAULT if not r.given("mp_policy.param_dtype") else Status.EXACT,
               f"null: compute in the loaded dtype, {master.value} (training_loop.master_dtype)")
    reduce = take(r, "mp_policy.reduce_dtype") or param
    output = take(r, "mp_policy.output_dtype")
    r.carry("mp_policy.output_dtype", name_in_torch(output) if output else None)
    r.carry("mp_policy.cast_forward_inputs", take(r, "mp_policy.cast_forward_inputs"), True)
    check_precision(r, "mp_policy.param_dtype", param, master, loop.loss_scaling)
    accumulate = accumulate_dtype_for(loop.batch.grad_sync, master=master, unsharded=reduce)
    r.report.add("training_loop.grad_sync", Status.EXACT, f"gradients accumulate in {accumulate.value}: reduced "
                 "shards in the loaded dtype, unsharded gradients with sync disabled in reduce_dtype",
                 target="precision.accumulate_dtype")
    return read_compute_copy(r.report, PrecisionSpec(
        param_dtype=param, master_dtype=master, reduce_dtype=reduce, accumulate_dtype=accumulate, buffer_dtype=None,
        loss_scaling=loop.loss_scaling, skip_nonfinite_steps=loop.skip_nonfinite_steps),
        "fsdp", key="mp_policy.param_dtype")


def write_fsdp2(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """The FSDP2 JSON form of ``spec``, every key explicit, with a report of
    what FSDP2 cannot state."""
    report = Report(source="spec", target=FMT)
    out: dict[str, Any] = {}
    plan = stage_plan(spec, report, target="reshard_after_forward")
    out["reshard_after_forward"], out["mesh"] = _write_sharding(spec, report, plan)
    param, reduce, master = resolve_precision(spec, report, target="mp_policy")
    out["mp_policy"] = _write_mp_policy(spec, report, param, reduce, master, plan.force_no_sync)
    offload, pinned = write_offload(spec, report, plan, target="offload_policy")
    out["offload_policy"] = {"pin_memory": pinned} if offload else None
    if offload and spec.offload.optimizer.enabled and spec.offload.optimizer.pin_memory != pinned:
        report.add("offload.optimizer.pin_memory", Status.APPROXIMATED, "FSDP2 has one pin_memory for both tiers",
                   target="offload_policy.pin_memory")
    out["wrap"] = write_wrap(spec, report, target="wrap")
    carried = spec.passthrough.get(FMT, {})
    for key in ("shard_placement_fn", "ignored_params"):
        if carried.get(key) is not None:
            out[key] = carried[key]
    _report_communication(spec, report)
    no_compile_form(spec, report, "fully_shard takes no compile argument: call module.compile(...) on the model "
                                  "or on each unit's module in the script")
    loop = write_training_loop(spec, report, param=param, force_no_sync=plan.force_no_sync,
                               clip_api="torch.nn.utils.clip_grad_norm_")
    loop["full_state_dict"] = checkpoint_format(spec, report, target="training_loop.full_state_dict") is \
        CheckpointFormat.FULL
    out["training_loop"] = loop
    report_no_wire_form(spec, report, "FSDP2 kwargs", {WireFormat.FP8: TORCHAO_RECIPE})
    report_carried(spec, report, own=FMT, target="FSDP2 kwargs", trainer=True)
    return Translation(out, report)


def _write_sharding(spec: StrategySpec, report: Report, plan: StagePlan) -> tuple[bool | int, dict[str, Any] | None]:
    s, world = spec.sharding, spec.sharding.world_size
    target = "reshard_after_forward"
    if not plan.sharded:
        report.add("sharding", Status.APPROXIMATED, "FSDP2 has no replicate-only form (use DDP or replicate()): "
                   + (f"written as the 2-D mesh [{world}, 1], shard groups of one rank, which is DDP's math with "
                      "FSDP2's per-unit collectives" if world else "without the world size no [world, 1] mesh can "
                      "be written, so this is reshard_after_forward=false over all ranks, which shards every state"),
                   target=target)
        if s.stage == 0 and s.shard_group != "world":
            report.add("sharding.shard_group", Status.IGNORED, "nothing is sharded at stage 0", target="mesh")
        return False, mesh_form([world, 1], spec, FMT, NAMES_KEY) if world else None
    shard = world
    mesh = mesh_form([world], spec, FMT, NAMES_KEY) if world else None
    if s.shard_group == "node":
        report.add("sharding.shard_group", Status.APPROXIMATED, "FSDP2 needs the node size as a number, in the 2-D "
                   "mesh [world / ranks per node, ranks per node]: written as one shard group over all ranks",
                   target="mesh")
    elif s.shard_group != "world":
        k = int(s.shard_group)
        if world:
            report.add("sharding.shard_group", Status.EXACT, f"HSDP: shard inside groups of {k}, replicate "
                       f"across {world // k}", target="mesh")
            shard, mesh = k, mesh_form([world // k, k], spec, FMT, NAMES_KEY)
        else:
            report.add("sharding.shard_group", Status.APPROXIMATED, f"a shard group of {k} ranks needs the 2-D mesh "
                       "[world/k, k], and the world size is unknown: written as one shard group over all ranks",
                       target="mesh")
            shard = None
    gather = s.backward_gather_group
    if gather is None:
        return plan.reshard_after_forward, mesh
    if gather == "node":
        report.add("sharding.backward_gather_group", Status.APPROXIMATED, "FSDP2 needs the node size as a number "
                   "(reshard_after_forward=<ranks per node>): written as true", target=target)
        return True, mesh
    if gather == 1:
        report.add("sharding.backward_gather_group", Status.EQUIVALENT, "a secondary shard over one rank keeps "
                   "full parameters after forward: written as false", target=target)
        return False, mesh
    if shard is not None and gather == shard:
        report.add("sharding.backward_gather_group", Status.EQUIVALENT, "a secondary shard over the whole shard "
                   "group is plain resharding: written as true", target=target)
        return True, mesh
    if shard is not None and shard % gather:
        report.add("sharding.backward_gather_group", Status.APPROXIMATED, f"{gather} does not divide the shard "
                   f"size {shard}, which torch requires: written as true", target=target)
        return True, mesh
    report.add("sharding.backward_gather_group", Status.EXACT, f"ZeRO++ hpZ: backward all-gathers inside groups "
               f"of {gather} ranks", target=target)
    return int(gather), mesh


def _write_mp_policy(spec: StrategySpec, report: Report, param: DType, reduce: DType, master: DType,
                     force_no_sync: bool) -> dict[str, Any]:
    p = spec.precision
    sync = GradSync.ACCUMULATION_BOUNDARY if force_no_sync else spec.batch.grad_sync
    accumulate = accumulate_dtype_for(sync, master=master, unsharded=reduce)
    if p.accumulate_dtype not in ("auto", accumulate):
        report.add("precision.accumulate_dtype", Status.APPROXIMATED, f"FSDP2 accumulates gradients in "
                   f"{accumulate.value}: reduced shards in the loaded dtype, unsharded gradients with sync disabled "
                   f"in reduce_dtype (the spec says {p.accumulate_dtype})", target="mp_policy")
    if p.buffer_dtype is not None and p.buffer_dtype is not master:
        report.add("precision.buffer_dtype", Status.NOT_EXPRESSIBLE, "FSDP2 has no buffer dtype: cast the buffers "
                   f"to {name_in_torch(p.buffer_dtype)} before fully_shard", target="mp_policy")
    carried = spec.passthrough.get(FMT, {})
    return {"param_dtype": name_in_torch(param), "reduce_dtype": name_in_torch(reduce),
            "output_dtype": carried.get("mp_policy.output_dtype"),
            "cast_forward_inputs": carried.get("mp_policy.cast_forward_inputs", True)}


def _report_communication(spec: StrategySpec, report: Report) -> None:
    c = spec.communication
    report_fixed_behaviour(spec, report)
    if c.forward_prefetch:
        report.add("communication.forward_prefetch", Status.NOT_EXPRESSIBLE, "FSDP2 has no flag: call "
                   "set_modules_to_forward_prefetch on the units to prefetch")
    if c.backward_prefetch is not BackwardPrefetch.BEFORE_GRAD:
        report.add("communication.backward_prefetch", Status.NOT_EXPRESSIBLE, "FSDP2 always issues the next "
                   f"backward all-gather before the current gradient computation, not {c.backward_prefetch.value}")
    if c.max_inflight_gathers == 2:
        report.add("communication.max_inflight_gathers", Status.EQUIVALENT, "FSDP2 has no limit flag: stream "
                   "synchronisation keeps about one unit's all-gather ahead, as FSDP1's limiter does")
    elif c.max_inflight_gathers is not None:
        report.add("communication.max_inflight_gathers", Status.NOT_EXPRESSIBLE, "FSDP2 has no limit flag: stream "
                   "synchronisation keeps about one unit's all-gather ahead")
