"""FSDP1 and FSDP2 translators: both directions, round trips, live torch objects.

The tests that construct FSDP share one single-process gloo group (module-scoped
fixture) and come last in this file: with a group initialised, the live
builders take the world size from it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zerobridge.backends.fsdp.kwargs import fsdp2_units, to_fsdp1_kwargs, to_fsdp2_kwargs
from zerobridge.errors import ConfigError
from zerobridge.spec import (
    BackwardPrefetch,
    CheckpointFormat,
    DynamicLossScale,
    EveryModuleWrap,
    GradSync,
    OffloadDevice,
    ParamSharding,
    RootWrap,
    ShardingSpec,
    SizeWrap,
    StaticLossScale,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.translate.fsdp1 import read_fsdp1, write_fsdp1
from zerobridge.translate.fsdp2 import read_fsdp2, write_fsdp2
from zerobridge.translate.report import Report, Status
from zerobridge.translate.sources import parse_json

RAF, RAB = ParamSharding.RESHARD_AFTER_FORWARD, ParamSharding.RESHARD_AFTER_BACKWARD
READ = {"fsdp1": read_fsdp1, "fsdp2": read_fsdp2}
WRITE = {"fsdp1": write_fsdp1, "fsdp2": write_fsdp2}


def read(fmt: str, data: dict[str, Any]) -> StrategySpec:
    return READ[fmt](parse_json(json.dumps(data, indent=2), f"{fmt}.json")).value


def spec_of(**fields: Any) -> StrategySpec:
    return StrategySpec.model_validate(fields)


def status(report: Report, key: str) -> Status | None:
    found = [e.status for e in report if e.key == key]
    return found[-1] if found else None


def note(report: Report, key: str) -> str:
    return " ".join(e.note for e in report if e.key == key)


def assert_round_trip(fmt: str, spec: StrategySpec) -> dict[str, Any]:
    """read(write(spec)) == spec, and writing again gives the same form."""
    written = WRITE[fmt](spec).value
    again = read(fmt, written)
    assert again == spec
    assert WRITE[fmt](again).value == written
    return written


# ----------------------------------------------------------------- sharding, FSDP1


@pytest.mark.parametrize(("strategy", "stage", "parameters", "group"), [
    ("FULL_SHARD", 3, RAF, "world"),
    ("SHARD_GRAD_OP", 3, RAB, "world"),
    ("NO_SHARD", 0, ParamSharding.REPLICATED, "world"),
    ("HYBRID_SHARD", 3, RAF, "node"),
    ("_HYBRID_SHARD_ZERO2", 3, RAB, "node"),
])
def test_fsdp1_strategies_both_directions(strategy: str, stage: int, parameters: ParamSharding, group: str) -> None:
    spec = read("fsdp1", {"sharding_strategy": strategy})
    assert (spec.sharding.stage, spec.sharding.parameters, spec.sharding.shard_group) == (stage, parameters, group)
    written = assert_round_trip("fsdp1", spec)
    assert written["sharding_strategy"] == strategy and written["device_mesh"] is None


@pytest.mark.parametrize("spelling", [1, "1", "full_shard", "ShardingStrategy.FULL_SHARD", "Full_Shard"])
def test_fsdp1_strategy_spellings(spelling: Any) -> None:
    assert read("fsdp1", {"sharding_strategy": spelling}).sharding.parameters is RAF


def test_fsdp1_hybrid_zero2_without_leading_underscore_and_by_number() -> None:
    for spelling in ("HYBRID_SHARD_ZERO2", 5, "hybrid_shard_zero2"):
        spec = read("fsdp1", {"sharding_strategy": spelling})
        assert (spec.sharding.parameters, spec.sharding.shard_group) == (RAB, "node")


def test_fsdp1_hybrid_with_mesh() -> None:
    spec = read("fsdp1", {"sharding_strategy": "HYBRID_SHARD",
                          "device_mesh": {"shape": [4, 8], "mesh_dim_names": ["dp_replicate", "dp_shard"]}})
    assert (spec.sharding.shard_group, spec.sharding.world_size, spec.sharding.is_hybrid) == (8, 32, True)
    assert assert_round_trip("fsdp1", spec)["device_mesh"]["shape"] == [4, 8]


def test_fsdp1_hybrid_shard_of_one_is_stage_0() -> None:
    translation = read_fsdp1(parse_json(json.dumps({"sharding_strategy": "HYBRID_SHARD",
                                                    "device_mesh": {"shape": [4, 1]}}), "x.json"))
    assert translation.value.sharding.stage == 0 and translation.value.sharding.world_size == 4
    assert status(translation.report, "device_mesh.shape") is Status.EQUIVALENT
    assert assert_round_trip("fsdp1", translation.value)["sharding_strategy"] == "NO_SHARD"


def test_fsdp1_mesh_dimensions_must_match_the_strategy() -> None:
    with pytest.raises(ConfigError, match="2-D mesh"):
        read("fsdp1", {"sharding_strategy": "HYBRID_SHARD", "device_mesh": {"shape": [8]}})
    with pytest.raises(ConfigError, match="1-D mesh"):
        read("fsdp1", {"sharding_strategy": "FULL_SHARD", "device_mesh": {"shape": [2, 4]}})


def test_fsdp1_numeric_shard_group_with_and_without_world_size() -> None:
    known = write_fsdp1(spec_of(sharding=ShardingSpec.for_stage(3, shard_group=8, world_size=32)))
    assert known.value["sharding_strategy"] == "HYBRID_SHARD"
    assert known.value["device_mesh"] == {"shape": [4, 8], "mesh_dim_names": ["dp_replicate", "dp_shard"]}
    assert status(known.report, "sharding.shard_group") is Status.EXACT
    unknown = write_fsdp1(spec_of(sharding=ShardingSpec.for_stage(3, shard_group=8)))
    assert unknown.value["sharding_strategy"] == "HYBRID_SHARD" and unknown.value["device_mesh"] is None
    assert status(unknown.report, "sharding.shard_group") is Status.APPROXIMATED
    assert "CPU" in note(unknown.report, "sharding.shard_group")


def test_fsdp1_node_group_warns_about_cpu_and_live_builder_refuses() -> None:
    spec = spec_of(sharding=ShardingSpec.for_stage(3, shard_group="node"),
                   wrapping=TransformerWrap(layer_classes=("Block",)))
    translation = write_fsdp1(spec)
    assert translation.value["sharding_strategy"] == "HYBRID_SHARD"
    assert "CPU" in note(translation.report, "sharding.shard_group")
    with pytest.raises(ConfigError, match="train alone"):
        to_fsdp1_kwargs(spec)


def test_fsdp1_cannot_express_hpz() -> None:
    spec = spec_of(sharding=ShardingSpec.for_stage(3, backward_gather_group=8))
    translation = write_fsdp1(spec)
    assert translation.value["sharding_strategy"] == "FULL_SHARD"
    assert status(translation.report, "sharding.backward_gather_group") is Status.NOT_EXPRESSIBLE


# ----------------------------------------------------------------- sharding, FSDP2


@pytest.mark.parametrize(("value", "parameters", "gather"), [(True, RAF, None), (False, RAB, None), (4, RAF, 4)])
def test_fsdp2_reshard_both_directions(value: bool | int, parameters: ParamSharding, gather: int | None) -> None:
    spec = read("fsdp2", {"reshard_after_forward": value, "mesh": {"shape": [16]}})
    assert (spec.sharding.stage, spec.sharding.parameters) == (3, parameters)
    assert (spec.sharding.backward_gather_group, spec.sharding.world_size) == (gather, 16)
    assert assert_round_trip("fsdp2", spec)["reshard_after_forward"] == value


def test_fsdp2_null_reshard_is_true_and_equivalent() -> None:
    translation = read_fsdp2(parse_json('{"reshard_after_forward": null}', "x.json"))
    assert translation.value.sharding.parameters is RAF
    assert status(translation.report, "reshard_after_forward") is Status.EQUIVALENT
    assert "root" in note(translation.report, "reshard_after_forward")
    assert write_fsdp2(translation.value).value["reshard_after_forward"] is True


@pytest.mark.parametrize(("value", "parameters"), [(1, RAB), (8, RAF)])
def test_fsdp2_int_reshard_edge_values_follow_torch(value: int, parameters: ParamSharding) -> None:
    translation = read_fsdp2(parse_json(json.dumps({"reshard_after_forward": value, "mesh": {"shape": [8]}}), "x"))
    assert translation.value.sharding.parameters is parameters
    assert translation.value.sharding.backward_gather_group is None
    assert status(translation.report, "reshard_after_forward") is Status.EQUIVALENT


def test_fsdp2_int_reshard_must_divide_the_shard_size() -> None:
    with pytest.raises(ConfigError, match="does not divide the shard size 8"):
        read("fsdp2", {"reshard_after_forward": 3, "mesh": {"shape": [2, 8]}})
    with pytest.raises(ConfigError, match="positive rank count"):
        read("fsdp2", {"reshard_after_forward": 0})


def test_fsdp2_2d_mesh_is_hybrid() -> None:
    spec = read("fsdp2", {"reshard_after_forward": 4, "mesh": {"shape": [2, 8], "mesh_dim_names": ["r", "s"]}})
    assert (spec.sharding.shard_group, spec.sharding.world_size, spec.sharding.backward_gather_group) == (8, 16, 4)
    assert spec.passthrough == {"fsdp2": {"mesh.mesh_dim_names": ["r", "s"]}}
    assert assert_round_trip("fsdp2", spec)["mesh"] == {"shape": [2, 8], "mesh_dim_names": ["r", "s"]}


def test_fsdp2_stage_0_is_approximated_by_a_shard_size_of_one() -> None:
    known = write_fsdp2(spec_of(sharding=ShardingSpec.for_stage(0, world_size=8)))
    assert known.value["mesh"]["shape"] == [8, 1] and known.value["reshard_after_forward"] is False
    assert status(known.report, "sharding") is Status.APPROXIMATED and "replicate()" in note(known.report, "sharding")
    assert read("fsdp2", known.value).sharding == ShardingSpec.for_stage(0, world_size=8)
    unknown = write_fsdp2(spec_of(sharding=ShardingSpec.for_stage(0)))
    assert unknown.value["mesh"] is None and status(unknown.report, "sharding") is Status.APPROXIMATED


def test_fsdp2_hpz_node_and_hybrid_node_need_numbers() -> None:
    translation = write_fsdp2(spec_of(sharding=ShardingSpec.for_stage(3, shard_group="node",
                                                                      backward_gather_group="node")))
    assert translation.value["reshard_after_forward"] is True and translation.value["mesh"] is None
    assert status(translation.report, "sharding.backward_gather_group") is Status.APPROXIMATED
    assert status(translation.report, "sharding.shard_group") is Status.APPROXIMATED


# ----------------------------------------------------------------- ZeRO-1 / ZeRO-2


@pytest.mark.parametrize("fmt", ["fsdp1", "fsdp2"])
def test_zero1_is_approximated_with_no_sync(fmt: str) -> None:
    translation = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(1)))
    assert status(translation.report, "sharding") is Status.APPROXIMATED
    assert "ZeRO-1 has no FSDP form" in note(translation.report, "sharding")
    assert translation.value["training_loop"]["grad_sync"] == "no_sync"
    assert status(translation.report, "batch.grad_sync") is Status.APPROXIMATED
    back = read(fmt, translation.value)
    assert (back.sharding.parameters, back.batch.grad_sync) == (RAB, GradSync.ACCUMULATION_BOUNDARY)


@pytest.mark.parametrize(("fmt", "key", "value"), [("fsdp1", "sharding_strategy", "SHARD_GRAD_OP"),
                                                   ("fsdp2", "reshard_after_forward", False)])
def test_zero2_is_approximated_as_resharded_after_backward(fmt: str, key: str, value: Any) -> None:
    translation = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(2)))
    assert translation.value[key] == value
    assert status(translation.report, "sharding") is Status.APPROXIMATED
    assert "ZeRO-2 keeps full parameters" in note(translation.report, "sharding")


def test_stage_0_is_exact_no_shard_with_deprecation_note() -> None:
    translation = write_fsdp1(spec_of(sharding=ShardingSpec.for_stage(0)))
    assert translation.value["sharding_strategy"] == "NO_SHARD"
    assert status(translation.report, "sharding") is Status.EXACT
    assert "deprecates" in note(translation.report, "sharding")


# ----------------------------------------------------------------- precision


def test_fsdp1_mixed_precision_keeps_master_weights_in_the_loaded_dtype() -> None:
    spec = read("fsdp1", {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}})
    p = spec.precision
    assert (p.param_dtype, p.master_dtype, p.reduce_dtype, p.accumulate_dtype) == ("bf16", "fp32", "fp32", "fp32")
    assert p.mixed and p.buffer_dtype is None
    mp = assert_round_trip("fsdp1", spec)["mixed_precision"]
    assert (mp["param_dtype"], mp["reduce_dtype"], mp["keep_low_precision_grads"]) == ("bfloat16", "float32", False)


def test_fsdp1_reduce_dtype_defaults_to_param_dtype() -> None:
    spec = read("fsdp1", {"mixed_precision": {"param_dtype": "torch.float16", "buffer_dtype": "bf16"}})
    assert (spec.precision.reduce_dtype, spec.precision.buffer_dtype) == ("fp16", "bf16")
    assert_round_trip("fsdp1", spec)


def test_fsdp1_no_mixed_precision_trains_in_the_loaded_dtype() -> None:
    spec = read("fsdp1", {"training_loop": {"master_dtype": "bfloat16"}})
    p = spec.precision
    assert (p.param_dtype, p.master_dtype, p.reduce_dtype, p.accumulate_dtype) == ("bf16",) * 4
    assert not p.mixed
    assert assert_round_trip("fsdp1", spec)["mixed_precision"] is None


def test_fsdp1_keep_low_precision_grads_is_carried_and_no_sync_accumulates_low() -> None:
    spec = read("fsdp1", {"mixed_precision": {"param_dtype": "bfloat16", "keep_low_precision_grads": True}})
    assert spec.passthrough == {"fsdp1": {"mixed_precision.keep_low_precision_grads": True}}
    assert spec.precision.accumulate_dtype == "fp32"  # reduced shards are upcast before accumulating
    assert assert_round_trip("fsdp1", spec)["mixed_precision"]["keep_low_precision_grads"] is True
    no_sync = read("fsdp1", {"mixed_precision": {"param_dtype": "bfloat16"}, "training_loop": {"grad_sync": "no_sync"}})
    assert no_sync.precision.accumulate_dtype == "bf16"


def test_fsdp2_accumulates_in_reduce_dtype_only_without_sync() -> None:
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert read("fsdp2", {"mp_policy": mp}).precision.accumulate_dtype == "fp32"
    spec = read("fsdp2", {"mp_policy": {"param_dtype": "bfloat16"}, "training_loop": {"grad_sync": "no_sync"}})
    assert spec.precision.accumulate_dtype == "bf16"
    assert assert_round_trip("fsdp2", spec)["mp_policy"]["reduce_dtype"] == "bfloat16"


def test_deepspeed_bf16_defaults_are_reported_against_fsdp() -> None:
    ds_bf16 = spec_of(sharding=ShardingSpec.for_stage(3), batch={"clip_grad_norm": 1.0},
                      precision={"param_dtype": "bf16", "master_dtype": "fp32", "skip_nonfinite_steps": True})
    for fmt in ("fsdp1", "fsdp2"):
        translation = WRITE[fmt](ds_bf16)
        assert status(translation.report, "precision.accumulate_dtype") is Status.APPROXIMATED
        assert translation.value["training_loop"]["clip_grad_norm"] == 1.0
        assert translation.value["training_loop"]["skip_nonfinite_steps"] is True
    assert write_fsdp1(ds_bf16).value["mixed_precision"]["reduce_dtype"] == "bfloat16"


def test_precision_fsdp_cannot_state_is_an_error() -> None:
    with pytest.raises(ConfigError, match="master weights") as info:
        read("fsdp1", {"mixed_precision": {"param_dtype": "float16"}, "training_loop": {"master_dtype": "bfloat16"}})
    assert info.value.key == "mixed_precision.param_dtype"


def test_fsdp2_has_no_buffer_dtype() -> None:
    translation = write_fsdp2(spec_of(sharding=ShardingSpec.for_stage(3), precision={"buffer_dtype": "bf16"}))
    assert status(translation.report, "precision.buffer_dtype") is Status.NOT_EXPRESSIBLE


# ----------------------------------------------------------------- loss scaling


def test_loss_scaler_reads_torch_defaults_and_skips_steps() -> None:
    spec = read("fsdp1", {"mixed_precision": {"param_dtype": "float16"}, "training_loop": {"loss_scaler": {}}})
    assert spec.precision.loss_scaling == DynamicLossScale(initial_scale=2.0**16, growth_interval=2000,
                                                           hysteresis=1, min_scale=0.0)
    assert spec.precision.skip_nonfinite_steps
    assert assert_round_trip("fsdp1", spec)["training_loop"]["loss_scaler"]["growth_interval"] == 2000


def test_loss_scaler_errors() -> None:
    with pytest.raises(ConfigError, match="float16"):
        read("fsdp2", {"mp_policy": {"param_dtype": "bfloat16"}, "training_loop": {"loss_scaler": {}}})
    with pytest.raises(ConfigError, match="contradicts"):
        read("fsdp1", {"mixed_precision": {"param_dtype": "float16"},
                       "training_loop": {"loss_scaler": {}, "skip_nonfinite_steps": False}})
    with pytest.raises(ConfigError, match="> 1"):
        read("fsdp1", {"mixed_precision": {"param_dtype": "float16"},
                       "training_loop": {"loss_scaler": {"growth_factor": 1.0}}})


def test_deepspeed_loss_scaling_is_approximated() -> None:
    fp16 = {"param_dtype": "fp16", "master_dtype": "fp32", "skip_nonfinite_steps": True}
    dynamic = write_fsdp2(spec_of(sharding=ShardingSpec.for_stage(3), precision=fp16 | {
        "loss_scaling": DynamicLossScale(growth_interval=1000, hysteresis=2, min_scale=1.0)}))
    assert dynamic.value["training_loop"]["loss_scaler"]["growth_interval"] == 1000
    assert status(dynamic.report, "precision.loss_scaling") is Status.APPROXIMATED
    assert "hysteresis" in note(dynamic.report, "precision.loss_scaling")
    static = write_fsdp1(spec_of(precision=fp16 | {"loss_scaling": StaticLossScale(scale=128.0)}))
    assert static.value["training_loop"]["loss_scaler"]["init_scale"] == 128.0
    assert status(static.report, "precision.loss_scaling") is Status.APPROXIMATED


# ----------------------------------------------------------------- offload


def test_param_offload_moves_both_tiers() -> None:
    spec = read("fsdp1", {"cpu_offload": {"offload_params": True}})
    assert spec.offload.parameters.device is OffloadDevice.CPU and spec.offload.optimizer.device is OffloadDevice.CPU
    assert assert_round_trip("fsdp1", spec)["cpu_offload"] == {"offload_params": True}
    pinned = read("fsdp2", {"offload_policy": {"pin_memory": False}})
    assert not pinned.offload.parameters.pin_memory and pinned.offload.optimizer.device is OffloadDevice.CPU
    assert assert_round_trip("fsdp2", pinned)["offload_policy"] == {"pin_memory": False}


@pytest.mark.parametrize("fmt", ["fsdp1", "fsdp2"])
def test_offload_tiers_fsdp_cannot_separate(fmt: str) -> None:
    key = "cpu_offload" if fmt == "fsdp1" else "offload_policy"
    optimizer_only = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(2), offload={"optimizer": {"device": "cpu"}}))
    assert optimizer_only.value[key] is None
    assert status(optimizer_only.report, "offload.optimizer.device") is Status.NOT_EXPRESSIBLE
    params_only = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(3), offload={"parameters": {"device": "cpu"}}))
    assert params_only.value[key] is not None
    assert status(params_only.report, "offload.parameters.device") is Status.APPROXIMATED


@pytest.mark.parametrize("fmt", ["fsdp1", "fsdp2"])
def test_nvme_offload_becomes_cpu_offload_reported_as_approximated(fmt: str) -> None:
    """ZeRO-Infinity's nearest runnable FSDP form is CPU offload (as Accelerate maps it), never none."""
    key = "cpu_offload" if fmt == "fsdp1" else "offload_policy"
    nvme = {"device": "nvme", "nvme_path": "/local_nvme"}
    infinity = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(3), offload={"optimizer": nvme, "parameters": nvme}))
    assert infinity.value[key] is not None
    for tier in ("parameters", "optimizer"):
        entry = infinity.report.find(f"offload.{tier}.device")
        assert entry is not None and entry.status is Status.APPROXIMATED and "nvme -> cpu" in entry.note
    params_only = WRITE[fmt](spec_of(sharding=ShardingSpec.for_stage(3), offload={"parameters": nvme}))
    assert params_only.value[key] is not None and "nvme -> cpu" in str(params_only.report.render())


@pytest.mark.parametrize("target, written", [("fsdp2", '"offload_policy": {'), ("fsdp1", '"offload_params": true'),
                                             ("accelerate-fsdp", "fsdp_offload_params: true")])
def test_zero_infinity_converts_to_cpu_offload_and_strict_refuses(target: str, written: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.cli import main

    assert main(["convert", "zero-infinity", "--to", target]) == 0
    out, err = capsys.readouterr()
    assert written in out and "approximated" in err
    assert main(["convert", "zero-infinity", "--to", target, "--strict"]) == 1
    assert capsys.readouterr().out == ""


def test_offload_with_no_shard_is_dropped_on_read() -> None:
    translation = read_fsdp1(parse_json('{"sharding_strategy": "NO_SHARD", "cpu_offload": {"offload_params": true}}',
                                        "x.json"))
    assert not translation.value.offload.parameters.enabled
    assert status(translation.report, "cpu_offload.offload_params") is Status.NOT_EXPRESSIBLE


# ----------------------------------------------------------------- errors


def test_unknown_key_names_the_closest() -> None:
    with pytest.raises(ConfigError) as info:
        read("fsdp1", {"sharding_stratgy": "FULL_SHARD"})
    assert info.value.key == "sharding_stratgy" and "'sharding_strategy'" in str(info.value)
    assert info.value.line == 2 and info.value.source == "fsdp1.json"
    with pytest.raises(ConfigError, match="did you mean 'reduce_dtype'") as nested:
        read("fsdp2", {"mp_policy": {"reduce_dtyp": "float32"}})
    assert nested.value.key == "mp_policy.reduce_dtyp"


@pytest.mark.parametrize(("fmt", "data", "key", "valid"), [
    ("fsdp1", {"sharding_strategy": "FULL"}, "sharding_strategy", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"),
    ("fsdp1", {"backward_prefetch": "PRE"}, "backward_prefetch", "BACKWARD_PRE, BACKWARD_POST, or null"),
    ("fsdp1", {"state_dict_type": "FULLY"}, "state_dict_type", "FULL_STATE_DICT"),
    ("fsdp2", {"training_loop": {"grad_sync": "never"}}, "training_loop.grad_sync", "every_micro_step, no_sync"),
])
def test_bad_enum_value_lists_the_valid_ones(fmt: str, data: dict[str, Any], key: str, valid: str) -> None:
    with pytest.raises(ConfigError, match="unknown value") as info:
        read(fmt, data)
    assert info.value.key == key and valid in (info.value.fix or "")


def test_bad_values_are_errors() -> None:
    with pytest.raises(ConfigError, match="must not be null"):
        read("fsdp1", {"sharding_strategy": None})
    with pytest.raises(ConfigError, match="not a multiple"):
        read("fsdp1", {"training_loop": {"micro_batch_size": 3, "global_batch_size": 10}})
    with pytest.raises(ConfigError, match="exactly one"):
        read("fsdp1", {"auto_wrap_policy": {"transformer_layer_cls": ["A"], "min_num_params": 10}})


# ----------------------------------------------------------------- the rest of the spec


def test_communication_fixed_by_fsdp_is_stated_and_reported_only_when_different() -> None:
    spec = read("fsdp1", {"backward_prefetch": None, "forward_prefetch": True, "limit_all_gathers": False})
    c = spec.communication
    assert (c.reduce_bucket, c.persistence_threshold, c.max_live_parameters) == ("per_unit", 0, None)
    assert (c.backward_prefetch, c.forward_prefetch, c.max_inflight_gathers) == (BackwardPrefetch.NONE, True, None)
    assert not assert_round_trip("fsdp1", spec)["limit_all_gathers"]
    assert write_fsdp1(spec).report.exact
    deepspeed = spec_of(sharding=ShardingSpec.for_stage(3),
                        communication={"persistence_threshold": 100_000, "max_live_parameters": 10**9})
    report = write_fsdp2(deepspeed).report
    for key in ("reduce_bucket", "prefetch_bucket", "persistence_threshold", "max_live_parameters"):
        assert status(report, f"communication.{key}") is Status.NOT_EXPRESSIBLE
    assert status(report, "communication.allgather_bucket") is None  # meaningless at stage 3


def test_wrapping_both_directions() -> None:
    cases = [({"transformer_layer_cls": ["LlamaDecoderLayer"]}, TransformerWrap(layer_classes=("LlamaDecoderLayer",))),
             ({"transformer_layer_cls": "auto"}, TransformerWrap()),
             ({"min_num_params": 1000}, SizeWrap(min_params=1000)), (None, RootWrap())]
    for form, wrap in cases:
        assert read("fsdp1", {"auto_wrap_policy": form}).wrapping == wrap
        assert assert_round_trip("fsdp2", read("fsdp2", {"wrap": form}))["wrap"] == form
    every = write_fsdp1(spec_of(wrapping=EveryModuleWrap(leaf_classes=("MoE",))))
    assert every.value["auto_wrap_policy"] == {"transformer_layer_cls": "auto"}
    assert status(every.report, "wrapping") is Status.APPROXIMATED and "MoE" in note(every.report, "wrapping")


def test_checkpoint_formats() -> None:
    assert read("fsdp1", {}).checkpoint.format is CheckpointFormat.FULL  # torch's default
    local = read_fsdp1(parse_json('{"state_dict_type": "LOCAL_STATE_DICT"}', "x.json"))
    assert local.value.checkpoint.format is CheckpointFormat.SHARDED
    assert status(local.report, "state_dict_type") is Status.APPROXIMATED
    assert read("fsdp2", {}).checkpoint.format is CheckpointFormat.SHARDED
    full = read("fsdp2", {"training_loop": {"full_state_dict": True}})
    assert assert_round_trip("fsdp2", full)["training_loop"]["full_state_dict"] is True
    consolidated = write_fsdp1(spec_of(checkpoint={"format": "consolidated_16bit"}))
    assert consolidated.value["state_dict_type"] == "FULL_STATE_DICT"
    assert status(consolidated.report, "checkpoint.format") is Status.APPROXIMATED


def test_training_loop_round_trip_and_auto_values() -> None:
    loop = {"clip_grad_norm": 0.5, "gradient_accumulation_steps": 4, "grad_sync": "no_sync", "micro_batch_size": 2,
            "global_batch_size": 64, "activation_checkpointing": True}
    spec = read("fsdp2", {"training_loop": loop})
    assert (spec.batch.clip_grad_norm, spec.batch.accumulation_steps, spec.batch.global_batch_size) == (0.5, 4, 64)
    assert spec.checkpoint.activation_checkpointing
    assert assert_round_trip("fsdp2", spec)["training_loop"].items() >= loop.items()
    assert read("fsdp1", {"training_loop": {"clip_grad_norm": 0}}).batch.clip_grad_norm is None
    auto = write_fsdp1(spec_of(batch={"clip_grad_norm": "auto", "micro_batch_size": "auto"}))
    loop = auto.value["training_loop"]
    assert "clip_grad_norm" not in loop and loop["micro_batch_size"] is None  # absent: left to the training script
    assert status(auto.report, "batch.clip_grad_norm") is Status.AUTO
    back = read("fsdp1", auto.value)
    assert (back.batch.clip_grad_norm, back.batch.micro_batch_size) == ("auto", None)
    assert read("fsdp2", {}).batch.accumulation_steps == "auto"


def test_passthrough_is_carried_and_other_formats_are_not_written() -> None:
    spec = read("fsdp1", {"use_orig_params": True, "param_init_fn": "my.init", "sync_module_states": False})
    assert spec.passthrough == {"fsdp1": {"use_orig_params": True, "param_init_fn": "my.init"}}
    written = assert_round_trip("fsdp1", spec)
    assert (written["use_orig_params"], written["sync_module_states"], written["param_init_fn"]) == (True, False,
                                                                                                     "my.init")
    other = spec_of(passthrough={"deepspeed": {"optimizer": {"type": "AdamW"}}})
    assert "optimizer" not in write_fsdp1(other).value


# ----------------------------------------------------------------- property tests

DTYPES = ["float32", "bfloat16", "float16"]
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def maybe(draw: st.DrawFn, out: dict[str, Any], key: str, values: st.SearchStrategy[Any]) -> None:
    if draw(st.booleans()):
        out[key] = draw(values)


@st.composite
def training_loops(draw: st.DrawFn, compute: str) -> dict[str, Any]:
    loop: dict[str, Any] = {}
    maybe(draw, loop, "clip_grad_norm", st.none() | st.floats(0, 10))
    accumulation = draw(st.integers(1, 8))
    maybe(draw, loop, "gradient_accumulation_steps", st.sampled_from([accumulation, None]))
    accumulation = loop.get("gradient_accumulation_steps") or 1
    maybe(draw, loop, "grad_sync", st.sampled_from(["every_micro_step", "no_sync", "NO_SYNC"]))
    micro = draw(st.none() | st.integers(1, 8))
    maybe(draw, loop, "micro_batch_size", st.just(micro))
    if micro is not None:
        maybe(draw, loop, "global_batch_size", st.sampled_from([None, micro * accumulation * draw(st.integers(1, 8))]))
    maybe(draw, loop, "activation_checkpointing", st.booleans())
    if compute == "float16" and draw(st.booleans()):
        scaler: dict[str, Any] = {}
        maybe(draw, scaler, "init_scale", st.floats(1, 2.0**24))
        maybe(draw, scaler, "growth_factor", st.floats(1.5, 4))
        maybe(draw, scaler, "backoff_factor", st.floats(0.1, 0.9))
        maybe(draw, scaler, "growth_interval", st.integers(1, 5000))
        loop["loss_scaler"] = scaler
        maybe(draw, loop, "skip_nonfinite_steps", st.just(True))
    else:
        maybe(draw, loop, "skip_nonfinite_steps", st.booleans())
    return loop


@st.composite
def precisions(draw: st.DrawFn) -> tuple[str, str | None, str]:
    """(loaded dtype, mixed-precision param dtype or None, effective compute dtype)."""
    master = draw(st.sampled_from(DTYPES))
    options = [None, master] + (["bfloat16", "float16"] if master == "float32" else [])
    param = draw(st.sampled_from(options))
    return master, param, param or master


@st.composite
def fsdp1_forms(draw: st.DrawFn) -> dict[str, Any]:
    form: dict[str, Any] = {}
    strategy = draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2",
                                     1, 2, 3, 4, 5, "hybrid_shard_zero2", "full_shard"]))
    maybe(draw, form, "sharding_strategy", st.just(strategy))
    strategy = form.get("sharding_strategy", "FULL_SHARD")
    hybrid = str(strategy).lower().lstrip("_") in ("hybrid_shard", "hybrid_shard_zero2") or strategy in (4, 5)
    dims = st.integers(1, 8)
    mesh = (st.builds(lambda r, s: {"shape": [r, s]}, dims, dims) if hybrid
            else st.builds(lambda n: {"shape": [n]}, dims))
    names = st.sampled_from([None, ["a", "b"] if hybrid else ["x"]])
    maybe(draw, form, "device_mesh", st.none() | st.builds(lambda m, n: m | ({"mesh_dim_names": n} if n else {}),
                                                           mesh, names))
    maybe(draw, form, "cpu_offload", st.none() | st.just({}) | st.builds(lambda b: {"offload_params": b},
                                                                          st.booleans()))
    maybe(draw, form, "backward_prefetch", st.sampled_from(["BACKWARD_PRE", "BACKWARD_POST", None, "backward_post"]))
    for key in ("forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states"):
        maybe(draw, form, key, st.booleans())
    maybe(draw, form, "param_init_fn", st.sampled_from(["pkg.init", None]))
    master, param, compute = draw(precisions())
    if draw(st.booleans()) or param is not None:
        mp: dict[str, Any] = {"param_dtype": param}
        maybe(draw, mp, "reduce_dtype", st.sampled_from([None, *DTYPES]))
        maybe(draw, mp, "buffer_dtype", st.sampled_from([None, *DTYPES]))
        for key in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            maybe(draw, mp, key, st.booleans())
        form["mixed_precision"] = mp
    policy = st.none() | st.builds(lambda n: {"transformer_layer_cls": n}, st.sampled_from([["Block"], ["A", "B"],
                                                                                             "auto"]))
    maybe(draw, form, "auto_wrap_policy", policy | st.builds(lambda n: {"min_num_params": n}, st.integers(1, 10**9)))
    maybe(draw, form, "state_dict_type", st.sampled_from(["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT",
                                                          1, 2, 3, "sharded"]))
    loop = draw(training_loops(compute))
    if master != "float32" or draw(st.booleans()):
        loop["master_dtype"] = draw(st.sampled_from([master, SHORT[master]]))
    maybe(draw, form, "training_loop", st.just(loop))
    assume("training_loop" in form or master == "float32")
    return form


@st.composite
def fsdp2_forms(draw: st.DrawFn) -> dict[str, Any]:
    form: dict[str, Any] = {}
    shard = draw(st.sampled_from([1, 2, 4, 8]))
    shape = draw(st.sampled_from([None, [shard], [draw(st.integers(1, 4)), shard]]))
    if shape is not None:
        form["mesh"] = {"shape": shape}
        maybe(draw, form["mesh"], "mesh_dim_names", st.just(["r", "s"] if len(shape) == 2 else ["s"]))
    divisors = [d for d in (1, 2, 4, 8) if shape is None or shard % d == 0]
    maybe(draw, form, "reshard_after_forward", st.sampled_from([True, False, None, *divisors]))
    master, param, compute = draw(precisions())
    mp: dict[str, Any] = {"param_dtype": param} if param is not None or draw(st.booleans()) else {}
    maybe(draw, mp, "reduce_dtype", st.sampled_from([None, *DTYPES]))
    maybe(draw, mp, "output_dtype", st.sampled_from([None, *DTYPES]))
    maybe(draw, mp, "cast_forward_inputs", st.booleans())
    maybe(draw, form, "mp_policy", st.just(mp))
    assume(param is None or "mp_policy" in form)
    maybe(draw, form, "offload_policy", st.none() | st.just({}) | st.builds(lambda b: {"pin_memory": b},
                                                                             st.booleans()))
    maybe(draw, form, "wrap", st.none() | st.just({"transformer_layer_cls": ["Block"]}) |
          st.builds(lambda n: {"min_num_params": n}, st.integers(1, 10**6)))
    maybe(draw, form, "shard_placement_fn", st.just("pkg.place"))
    loop = draw(training_loops(compute))
    loop["master_dtype"] = master
    maybe(draw, loop, "full_state_dict", st.booleans())
    form["training_loop"] = loop
    return form


FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.filter_too_much])


@FAST
@given(fsdp1_forms())
def test_fsdp1_forms_round_trip(form: dict[str, Any]) -> None:
    assert_round_trip("fsdp1", read("fsdp1", form))


@FAST
@given(fsdp2_forms())
def test_fsdp2_forms_round_trip(form: dict[str, Any]) -> None:
    assert_round_trip("fsdp2", read("fsdp2", form))


@st.composite
def specs(draw: st.DrawFn) -> StrategySpec:
    stage = draw(st.integers(0, 3))
    world = draw(st.sampled_from([None, 1, 2, 4, 8, 16]))
    sizes = [n for n in (1, 2, 4, 8) if world is None or world % n == 0]
    group = draw(st.sampled_from(["world", "node", *sizes]))
    sharding: dict[str, Any] = {"world_size": world, "shard_group": group}
    if stage == 3:
        sharding["parameters"] = draw(st.sampled_from([RAF, RAB]))
        if sharding["parameters"] is RAF:
            gathers = [n for n in sizes if not isinstance(group, int) or group % n == 0]
            sharding["backward_gather_group"] = draw(st.sampled_from([None, "node", *gathers]))
    devices = st.sampled_from(["none", "cpu", "nvme"])
    offload: dict[str, Any] = {}
    if stage >= 1:
        offload["optimizer"] = {"device": draw(devices), "pin_memory": draw(st.booleans()), "nvme_path": "/nvme"}
        if stage == 3 and offload["optimizer"]["device"] != "none":
            offload["optimizer"]["ratio"] = draw(st.sampled_from([1.0, 0.5]))
    if stage == 3:
        offload["parameters"] = {"device": draw(devices), "pin_memory": draw(st.booleans()), "nvme_path": "/nvme"}
    offload["sub_group_size"] = draw(st.sampled_from([10**9, 10**8]))
    master = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    param = draw(st.sampled_from(["auto", master] + (["bf16", "fp16"] if master == "fp32" else [])))
    precision: dict[str, Any] = {
        "param_dtype": param, "master_dtype": master,
        "reduce_dtype": draw(st.sampled_from(["auto", "fp32", "bf16", "fp16"])),
        "accumulate_dtype": draw(st.sampled_from(["auto", "fp32", "bf16", "fp16"])),
        "buffer_dtype": draw(st.sampled_from([None, "fp32", "bf16"])),
        "skip_nonfinite_steps": draw(st.booleans())}
    if param in ("fp16", "auto"):
        precision["loss_scaling"] = draw(st.sampled_from([{"kind": "none"}, {"kind": "static", "scale": 1024.0},
                                                          {"kind": "dynamic"}, {"kind": "dynamic", "hysteresis": 1,
                                                                                "min_scale": 0.0}]))
    buckets = st.sampled_from([500_000_000, "per_unit", "auto"])
    communication = {"reduce_bucket": draw(buckets), "allgather_bucket": draw(buckets),
                     "prefetch_bucket": draw(buckets),
                     "overlap_reduce": draw(st.booleans()), "forward_prefetch": draw(st.booleans()),
                     "backward_prefetch": draw(st.sampled_from(list(BackwardPrefetch))),
                     "max_inflight_gathers": draw(st.sampled_from([None, 2, 4])),
                     "persistence_threshold": draw(st.sampled_from([0, 100_000, "auto"])),
                     "max_live_parameters": draw(st.sampled_from([None, 10**9]))}
    wrapping = draw(st.sampled_from([RootWrap(), EveryModuleWrap(), TransformerWrap(), SizeWrap(min_params=10**6),
                                     TransformerWrap(layer_classes=("Block",))]))
    batch = {"micro_batch_size": draw(st.sampled_from([None, "auto", 4])),
             "accumulation_steps": draw(st.sampled_from([1, 4, "auto", None])),
             "grad_sync": draw(st.sampled_from(list(GradSync))),
             "clip_grad_norm": draw(st.sampled_from([None, "auto", 0.0, 1.0]))}
    checkpoint = {"format": draw(st.sampled_from(["sharded", "full", "consolidated_16bit", "auto"])),
                  "activation_checkpointing": draw(st.booleans())}
    try:
        return StrategySpec.model_validate({
            "sharding": ShardingSpec.for_stage(stage, **sharding).model_dump(), "offload": offload,
            "precision": precision, "communication": communication, "wrapping": wrapping, "batch": batch,
            "checkpoint": checkpoint, "passthrough": {"deepspeed": {"optimizer": {"type": "AdamW"}}}})
    except ValueError:
        assume(False)
        raise


@FAST
@given(specs(), st.sampled_from(["fsdp1", "fsdp2"]))
def test_any_spec_writes_readably_and_flags_what_changed(spec: StrategySpec, fmt: str) -> None:
    translation = WRITE[fmt](spec)
    written = translation.value
    json.dumps(written)  # plain JSON
    assert WRITE[fmt](read(fmt, written)).value == written  # writing is a fixed point after one round
    flagged = {e.key for e in translation.report.approximations}
    if spec.sharding.stage in (1, 2) and spec.sharding.shard_group != 1:  # groups of one shard nothing
        assert "sharding" in flagged
    tiers = spec.offload.optimizer.device, spec.offload.parameters.device
    if OffloadDevice.NVME in tiers or tiers == (OffloadDevice.CPU, OffloadDevice.NONE):
        assert {key for key in flagged if key.startswith("offload")}
    if spec.sharding.backward_gather_group is not None and fmt == "fsdp1":
        assert "sharding.backward_gather_group" in flagged
    if not spec.communication.overlap_reduce:
        assert "communication.overlap_reduce" in flagged
    if isinstance(spec.wrapping, EveryModuleWrap):
        assert "wrapping" in flagged


# ----------------------------------------------------------------- live objects, no process group


def tiny_model() -> Any:
    from torch import nn

    class Block(nn.Module):  # the layer class the wrap policies name
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return x + self.inner(x).relu()

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 2)

        def forward(self, x: Any) -> Any:
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Tiny()


def test_to_fsdp1_kwargs_returns_torch_objects() -> None:
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    assert not dist.is_initialized()
    model = tiny_model()
    spec = read("fsdp1", {"sharding_strategy": "SHARD_GRAD_OP", "use_orig_params": True,
                          "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                          "auto_wrap_policy": {"transformer_layer_cls": ["Block"]},
                          "backward_prefetch": "BACKWARD_POST"})
    kwargs = to_fsdp1_kwargs(spec, module=model)
    assert kwargs["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    assert kwargs["backward_prefetch"] is TorchPrefetch.BACKWARD_POST
    assert kwargs["cpu_offload"] is None and kwargs["use_orig_params"] is True and kwargs["limit_all_gathers"] is True
    assert kwargs["mixed_precision"] == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = kwargs["auto_wrap_policy"]
    assert isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy
    assert policy.keywords["transformer_layer_cls"] == {type(model.layers[0])}
    assert kwargs["device_id"] == torch.device("cpu") and "device_mesh" not in kwargs
    assert not {"training_loop", "state_dict_type"} & set(kwargs)
    size = to_fsdp1_kwargs(spec_of(sharding=ShardingSpec.for_stage(3), wrapping=SizeWrap(min_params=64)))
    assert size["auto_wrap_policy"].func is size_based_auto_wrap_policy
    assert size["auto_wrap_policy"].keywords == {"min_num_params": 64}


def test_fsdp1_offload_needs_an_accelerator() -> None:
    import torch
    from torch.distributed.fsdp import CPUOffload

    spec = read("fsdp1", {"cpu_offload": {"offload_params": True}})
    if torch.cuda.is_available():
        assert to_fsdp1_kwargs(spec)["cpu_offload"] == CPUOffload(offload_params=True)
    else:
        with pytest.raises(ConfigError, match="CPU-only"):
            to_fsdp1_kwargs(spec)


def test_layer_class_names_must_exist_in_the_model() -> None:
    spec = spec_of(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap(layer_classes=("LlamaDecoderLayer",)))
    with pytest.raises(ConfigError, match="LlamaDecoderLayer") as info:
        to_fsdp1_kwargs(spec, module=tiny_model())
    assert "Block" in (info.value.fix or "") and "Tiny" in (info.value.fix or "")
    with pytest.raises(ConfigError, match="_no_split_modules"):
        to_fsdp1_kwargs(spec_of(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap()), module=tiny_model())


def test_to_fsdp2_kwargs_returns_torch_objects() -> None:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    spec = read("fsdp2", {"reshard_after_forward": False, "mp_policy": {"param_dtype": "bfloat16"},
                          "offload_policy": {"pin_memory": True}, "wrap": {"transformer_layer_cls": ["Block"]}})
    kwargs = to_fsdp2_kwargs(spec)
    assert set(kwargs) == {"reshard_after_forward", "mp_policy", "offload_policy"}
    assert kwargs["reshard_after_forward"] is False
    assert kwargs["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    assert kwargs["offload_policy"].pin_memory is torch.cuda.is_available()
    assert type(to_fsdp2_kwargs(spec_of(sharding=ShardingSpec.for_stage(3)))["offload_policy"]) is OffloadPolicy
    model = tiny_model()
    assert fsdp2_units(spec, model) == list(model.layers)
    assert fsdp2_units(spec_of(wrapping=SizeWrap(min_params=70)), model) == [layer.inner for layer in model.layers]


# ----------------------------------------------------------------- live objects, gloo group (keep last)


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def train_step(model: Any) -> Any:
    import torch

    torch.manual_seed(0)
    loss = model(torch.randn(3, 4)).float().square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp1_constructs_and_trains(gloo: Any, strategy: str) -> None:
    import warnings

    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = tiny_model()
    spec = read("fsdp1", {"sharding_strategy": strategy, "mixed_precision": {"param_dtype": "bfloat16"},
                          "auto_wrap_policy": {"transformer_layer_cls": ["Block"]}})
    kwargs = to_fsdp1_kwargs(spec, module=model)
    assert isinstance(kwargs["device_mesh"], DeviceMesh) and kwargs["device_mesh"].size() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 switches to NO_SHARD; NO_SHARD is deprecated
        wrapped = FSDP(model, **kwargs)
    units = [m for m in wrapped.modules() if isinstance(m, FSDP)]
    assert len(units) == 3  # root + one per Block
    assert torch.isfinite(train_step(wrapped))
    grads = [p.grad for p in wrapped.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)  # upcast to the loaded dtype
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())


@pytest.mark.parametrize(("reshard", "offload"), [(True, False), (False, True)])
def test_fsdp2_fully_shard_trains(gloo: Any, reshard: bool, offload: bool) -> None:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    model = tiny_model()
    spec = read("fsdp2", {"reshard_after_forward": reshard, "mesh": {"shape": [1]},
                          "mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                          "offload_policy": {"pin_memory": True} if offload else None,
                          "wrap": {"transformer_layer_cls": ["Block"]}})
    kwargs = to_fsdp2_kwargs(spec)
    assert kwargs["mesh"].mesh_dim_names == ("dp_shard",)
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy) is offload
    for unit in fsdp2_units(spec, model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers)
    assert torch.isfinite(train_step(model))
    for param in model.parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32  # sharded in the loaded dtype
        assert param.grad is not None and param.grad.dtype == torch.float32
