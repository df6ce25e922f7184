"""torchtitan job config (TOML) -> spec. The writer is ``torchtitan_write.py``; the TOML is the
``--job.config_file`` schema of torchtitan's TOML releases (0.3.0 moved to config-as-code).

    >>> from zerobridge.translate.sources import parse_toml
    >>> from zerobridge.translate.torchtitan import read_torchtitan
    >>> text = '''
    ... [parallelism]
    ... data_parallel_replicate_degree = 2
    ... data_parallel_shard_degree = 4
    ... [training]
    ... local_batch_size = 2
    ... '''
    >>> spec = read_torchtitan(parse_toml(text, "job.toml")).value
    >>> spec.summary()
    'stage 3, params reshard_after_forward, shard group 4, compute bf16'
    >>> spec.precision.master_dtype.value, spec.precision.reduce_dtype.value, spec.sharding.world_size
    ('fp32', 'fp32', 8)

torchtitan applies FSDP2 itself: the reader builds the ``fully_shard``
arguments torchtitan passes (its mesh, reshard policy and mixed-precision
policy) and hands them to the FSDP2 reader; tensor, pipeline, context and
expert parallelism are reported as not expressible. ``[compile]`` (older:
``training.compile``) compiles every TransformerBlock, the spec's units. ``data_parallel_shard_degree
= -1`` needs the world size (``world_size=``, torchrun's WORLD_SIZE); without it
the shard group is read as the whole data-parallel world.
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import DType, StrategySpec, WireFormat
from zerobridge.translate.compilation import read_torchtitan_compile
from zerobridge.translate.fsdp2 import read_fsdp2
from zerobridge.translate.keys import SourceKeys, chain_report, update_spec
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located
from zerobridge.translate.wire import read_float8_gather

__all__ = ["read_torchtitan"]

FORMAT = "torchtitan"
_P, _T = "parallelism.", "training."
_RENAMES = {
    "reshard_after_forward": _P + "fsdp_reshard_after_forward", "mesh": _P + "data_parallel_shard_degree",
    "mp_policy.param_dtype": _T + "mixed_precision_param",
    "mp_policy.reduce_dtype": _T + "mixed_precision_reduce", "offload_policy": _T + "enable_cpu_offload",
    "offload_policy.": _T + "enable_cpu_offload", "training_loop.clip_grad_norm": _T + "max_norm",
    "training_loop.micro_batch_size": _T + "local_batch_size",
    "training_loop.global_batch_size": _T + "global_batch_size",
    "training_loop.activation_checkpointing": "activation_checkpoint.mode",
    "training_loop.full_state_dict": "checkpoint.enable_checkpoint",
}
_DTYPES = {"bfloat16": DType.BF16, "float32": DType.FP32}
_NOT_IN_SPEC = (*(f"{_P}{name}_degree" for name in ("tensor_parallel", "pipeline_parallel", "context_parallel",
                                                     "expert_parallel")), "checkpoint.enable_checkpoint")
"""Keys read (and reported) whose values the spec has no field for: carried for ``--to torchtitan``."""
BLOCK_CLASS = "TransformerBlock"
"""The class of the blocks torchtitan's models keep in ``model.layers``, each its own fully_shard unit."""


def read_torchtitan(located: Located, *, world_size: int | None = None) -> Translation[StrategySpec]:
    """The spec a torchtitan TOML means; ``world_size``: the number of ranks torchrun starts."""
    report = Report(source=FORMAT, target="spec")
    keys = SourceKeys(located, load_table(FORMAT), report, consumer="torchtitan", bools="accelerate")
    degrees = {name: keys.get(f"{_P}{name}_degree") for name in (
        "data_parallel_replicate", "data_parallel_shard", "tensor_parallel", "pipeline_parallel",
        "context_parallel", "expert_parallel")}
    for name, size in degrees.items():
        if size < 1 and not (name == "data_parallel_shard" and size == -1):
            raise located.error(f"must be a positive degree{' or -1' if name == 'data_parallel_shard' else ''}, "
                                f"got {size}", key=keys.key(f"{_P}{name}_degree"))
    replicate, shard = degrees["data_parallel_replicate"], degrees["data_parallel_shard"]
    tp, pp, cp = degrees["tensor_parallel"], degrees["pipeline_parallel"], degrees["context_parallel"]
    others = replicate * tp * pp * cp
    if shard == -1 and world_size is not None:
        if world_size % others:
            raise located.error(f"world size {world_size} is not a multiple of replicate x tp x pp x cp = {others}",
                                key=keys.key(_P + "data_parallel_shard_degree"), fix="change the degrees")
        shard = world_size // others
    if shard != -1 and world_size is not None and shard * others != world_size:
        raise located.error(f"the degrees multiply to {shard * others}, not the world size {world_size} "
                            "(torchtitan asserts they match)", key=keys.key(_P + "data_parallel_shard_degree"))
    group = shard * cp if shard != -1 else None
    dp_world = replicate * group if group is not None else None
    _note_degrees(keys, degrees, shard, group, dp_world, world_size)
    param = _DTYPES[keys.get(_T + "mixed_precision_param")]
    reduce = _DTYPES[keys.get(_T + "mixed_precision_reduce")]
    micro, global_batch = keys.get(_T + "local_batch_size"), keys.get(_T + "global_batch_size")
    data_parallel = dp_world if dp_world is not None else None
    if global_batch == -1:
        accumulation: Any = 1
        global_batch = micro * data_parallel if data_parallel else None
    elif data_parallel:
        if global_batch % (micro * data_parallel):
            raise located.error(f"global_batch_size {global_batch} is not a multiple of local_batch_size x "
                                f"data-parallel degree = {micro} x {data_parallel}",
                                key=keys.key(_T + "global_batch_size"))
        accumulation = global_batch // (micro * data_parallel)
    else:
        accumulation = None
        keys.note(_T + "global_batch_size", extra="accumulation = global / (local x data-parallel degree), derived "
                  "at run time: the data-parallel degree needs the world size")
    fsdp = shard == -1 or shard > 1 or cp > 1
    mode = keys.get("activation_checkpoint.mode")
    keys.note("activation_checkpoint.mode", Status.APPROXIMATED if mode == "selective" else None,
              "the spec's flag recomputes every unit; selective recomputes only some" if mode == "selective" else "")
    if fsdp:
        spec = _read_fsdp(keys, replicate, group, param, reduce, micro, global_batch, accumulation, mode != "none",
                          pp > 1)
    else:
        spec = _read_ddp(keys, replicate, param, micro, global_batch, accumulation, mode != "none")
    gathers = [read_float8_gather(keys, path, sharded=fsdp, consumer="torchtitan") for path in (
        "float8.enable_fsdp_float8_all_gather", "quantize.linear.float8.enable_fsdp_float8_all_gather")]
    if WireFormat.FP8 in gathers:
        spec = update_spec(spec, {"communication.wire.param_gather": WireFormat.FP8})
    spec = update_spec(spec, {"sharding.world_size": dp_world if fsdp else replicate,
                              "batch.accumulation_steps": accumulation, "batch.global_batch_size": global_batch,
                              "compile": read_torchtitan_compile(keys, per_block=fsdp)})
    keys.note_rest()
    for path in _NOT_IN_SPEC:  # what the spec cannot hold goes back out with the other sections
        if keys.given(path):
            keys.carry(path, keys.values[path], default=object())
    carried = keys.passthrough()
    if carried:
        spec = update_spec(spec, {"passthrough": {**spec.passthrough, FORMAT: carried}})
    return Translation(spec, report)


def _note_degrees(keys: SourceKeys, degrees: dict[str, int], shard: int, group: int | None, dp_world: int | None,
                  world_size: int | None) -> None:
    replicate = degrees["data_parallel_replicate"]
    keys.note(_P + "data_parallel_replicate_degree",
              extra="HSDP: shard inside each group, replicate across groups (torchtitan maps it to MiCS)"
              if replicate > 1 and (shard == -1 or shard > 1) else "")
    if degrees["data_parallel_shard"] == -1:
        keys.note(_P + "data_parallel_shard_degree", Status.APPROXIMATED if replicate > 1 and not world_size else
                  Status.EXACT, f"-1 with world size {world_size}: {shard} ranks" if world_size else
                  "-1: all ranks the other degrees leave, the whole data-parallel world" + (
                      "; with replicas the group size needs the world size (read_torchtitan(..., world_size=N)), "
                      "so the replicas are lost" if replicate > 1 else ""))
    else:
        keys.note(_P + "data_parallel_shard_degree")
    mesh = f"the {dp_world}-rank data-parallel mesh" if dp_world else "the data-parallel mesh"
    for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
        size, path = degrees[name], f"{_P}{name}_degree"
        if size > 1:
            keys.note(path, extra=f"the spec describes {mesh}" + (f" (shard x context = {group} ranks)"
                                                                  if name == "context_parallel" and group else ""))
        elif keys.given(path):
            keys.note(path, Status.EXACT, "off")


def _read_fsdp(keys: SourceKeys, replicate: int, group: int | None, param: DType, reduce: DType, micro: int,
               global_batch: int | None, accumulation: Any, recompute: bool, pipelined: bool) -> StrategySpec:
    policy = keys.get(_P + "fsdp_reshard_after_forward")
    reshard = {"always": True, "never": False}.get(policy, not pipelined)
    keys.note(_P + "fsdp_reshard_after_forward",
              extra=f"default: {'off, pipeline parallelism is on' if pipelined else 'on'}"
              if policy == "default" else "")
    shape = ([replicate, group] if replicate > 1 else [group]) if group is not None else None
    offload = keys.get(_T + "enable_cpu_offload")
    names = {DType.BF16: "bfloat16", DType.FP32: "float32"}
    loop: dict[str, Any] = {"clip_grad_norm": keys.get(_T + "max_norm"), "micro_batch_size": micro,
                            "activation_checkpointing": recompute, "master_dtype": "float32",
                            "full_state_dict": False}
    if accumulation is not None:
        loop["gradient_accumulation_steps"] = accumulation
        loop["global_batch_size"] = global_batch
    kwargs = {"reshard_after_forward": reshard, "mesh": {"shape": shape} if shape else None,
              "mp_policy": {"param_dtype": names[param], "reduce_dtype": names[reduce]},
              "offload_policy": {"pin_memory": True} if offload else None,
              "wrap": {"transformer_layer_cls": [BLOCK_CLASS]}, "training_loop": loop}
    t: Translation[StrategySpec] = read_fsdp2(Located(kwargs, f"{keys.located.source} (fully_shard arguments)"))
    chain_report(keys.report, t.report, _RENAMES, "FSDP2 kwarg")
    keys.report.add("model.layers", Status.EQUIVALENT, "torchtitan calls fully_shard on every block of model.layers, "
                    "on the token embedding, and on the final norm with the output layer", target="wrapping")
    keys.report.add("checkpoint.enable_checkpoint", Status.EXACT, "torchtitan saves DCP shards (sharded)",
                    target="checkpoint.format")
    return t.value


def _read_ddp(keys: SourceKeys, replicate: int, param: DType, micro: int, global_batch: int | None,
              accumulation: Any, recompute: bool) -> StrategySpec:
    keys.note(_T + "mixed_precision_reduce", Status.IGNORED, "takes effect only under FSDP: DDP reduces the fp32 "
              "gradients in fp32")
    for path in (_P + "fsdp_reshard_after_forward", _T + "enable_cpu_offload"):
        if keys.given(path):
            keys.note(path, Status.IGNORED, "FSDP is off (data_parallel_shard_degree 1)")
    keys.report.add(_P + "data_parallel_shard_degree", Status.EXACT, "1: no FSDP; " + (
        f"DDP over {replicate} replicas, compute under autocast" if replicate > 1 else "a single data-parallel rank"),
        target="sharding")
    return StrategySpec.model_validate({
        "precision": {"param_dtype": param, "master_dtype": DType.FP32, "reduce_dtype": DType.FP32,
                      "accumulate_dtype": DType.FP32},
        "batch": {"micro_batch_size": micro, "global_batch_size": global_batch,
                  "clip_grad_norm": keys.get(_T + "max_norm") or None},
        "checkpoint": {"format": "sharded", "activation_checkpointing": recompute}})
