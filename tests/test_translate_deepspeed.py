"""DeepSpeed JSON <-> spec, on fixtures written here. No process group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import corpus_files
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobridge.errors import ConfigError
from zerobridge.spec import AUTO, DType, Stage, StrategySpec
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.report import Status
from zerobridge.translate.sources import Located, parse_json
from zerobridge.translate.sources import read_text as read_file_text


def read(config: dict[str, Any]) -> Any:
    return read_deepspeed(Located(config, "ds.json"))


def read_text(text: str) -> Any:
    return read_deepspeed(parse_json(text, "ds.json"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage(stage: int) -> None:
    t = read({"zero_optimization": {"stage": stage}})
    assert t.value.sharding.stage == Stage(stage)
    assert t.value.communication.overlap_reduce is (stage == 3)  # DeepSpeed's by-stage default
    sync = "accumulation_boundary" if stage <= 1 else "every_micro_step"
    assert t.value.batch.grad_sync.value == sync
    assert t.value.batch.clip_grad_norm == 1.0  # DeepSpeed >= 0.19.3 default, made explicit
    assert t.report.find("gradient_clipping").status is Status.DEFAULT


def test_hjson_comments_trailing_commas_and_float_integers() -> None:
    t = read_text("""{
      // ZeRO-3 with sizes written the way DeepSpeed configs write them
      "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_max_live_parameters": 1e9,},
      "train_micro_batch_size_per_gpu": 4,
    }""")
    assert t.value.communication.reduce_bucket == 500_000_000
    assert t.value.communication.max_live_parameters == 1_000_000_000
    assert t.value.batch.micro_batch_size == 4


def test_duplicate_keys_are_rejected_with_line() -> None:
    with pytest.raises(ConfigError) as err:
        read_text('{"zero_optimization": {"stage": 2},\n "zero_optimization": {"stage": 3}}')
    assert "duplicate key 'zero_optimization'" in str(err.value) and "ds.json:2" in str(err.value)


def test_aliases_and_conflicting_aliases() -> None:
    a = read({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 123}})
    b = read({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123}})
    assert a.value == b.value and a.value.communication.prefetch_bucket == 123
    assert "alias of zero_optimization.stage3_prefetch_bucket_size" in b.report.find(
        "zero_optimization.prefetch_bucket_size").note
    with pytest.raises(ConfigError, match="given twice"):
        read({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


def test_deprecated_keys() -> None:
    t = read({"zero_optimization": {"stage": 2, "cpu_offload": True}, "bfloat16": {"enabled": True}})
    assert t.value.offload.optimizer.device.value == "cpu"
    assert t.value.precision.param_dtype is DType.BF16
    assert "deprecated" in t.report.find("zero_optimization.cpu_offload").note
    t = read({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert t.value.checkpoint.format is CheckpointFormat.CONSOLIDATED_16BIT
    with pytest.raises(ConfigError, match="together with its replacement"):
        read({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_auto_is_kept_and_reported() -> None:
    t = read({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
              "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                               "stage3_param_persistence_threshold": "auto"}})
    v = t.value
    assert (v.batch.global_batch_size, v.batch.micro_batch_size, v.batch.clip_grad_norm) == (AUTO, AUTO, AUTO)
    assert v.precision.param_dtype == AUTO and v.communication.reduce_bucket == AUTO
    assert t.report.find("zero_optimization.reduce_bucket_size").status is Status.AUTO
    out = write_deepspeed(v).value
    assert out["zero_optimization"]["reduce_bucket_size"] == AUTO and out["gradient_clipping"] == AUTO


def test_not_about_sharding_sections_are_carried_and_re_emitted() -> None:
    optimizer = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
    t = read({"zero_optimization": {"stage": 2, "contiguous_gradients": True}, "optimizer": optimizer,
              "steps_per_print": 10})
    assert t.report.find("optimizer").status is Status.NOT_ABOUT_SHARDING
    out = write_deepspeed(t.value).value
    assert out["optimizer"] == optimizer and out["steps_per_print"] == 10
    assert out["zero_optimization"]["contiguous_gradients"] is True


@pytest.mark.parametrize("config, fragment, fix", [
    ({"zero_optimization": {"stage": 3, "reduce_bucket_sise": 1}}, "unknown key 'reduce_bucket_sise'",
     "reduce_bucket_size"),
    ({"fp16": {"enabled": True, "loss_scal": 0}}, "unknown key 'loss_scal'", "loss_scale"),
    ({"train_micro_batch_size_per_gpux": 1}, "DeepSpeed would silently ignore it", "train_micro_batch_size_per_gpu"),
    ({"zero_optimization": {"stage": 4}}, "expected a ZeRO stage", None),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}}, "expected an integer", None),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true", "enable one"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     "not a multiple of", None),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "needs nvme_path", None),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, "expected one of none, cpu, nvme", None),
    ({"fp16": {"enabled": True, "loss_scale_window": -1}}, "fp16.loss_scale_window: Input should be greater", None),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis", None),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 2}}},
     "zero_optimization.offload_optimizer.ratio: Input should be less than or equal to 1", None),
    ({"fp16": None}, "fp16: expected a section", "as an object"),
    ({"zero_optimization": "three"}, "zero_optimization: expected a section", None),
])
def test_bad_input(config: dict[str, Any], fragment: str, fix: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        read(config)
    assert fragment in str(err.value)
    assert "ds.json" in str(err.value)
    if fix:
        assert fix in str(err.value)


def test_error_names_the_line() -> None:
    text = '{\n  "zero_optimization": {\n    "stage": 3,\n    "overlap_com": true\n  }\n}'
    with pytest.raises(ConfigError) as err:
        read_text(text)
    assert err.value.line == 4 and err.value.key == "zero_optimization.overlap_com"
    assert "did you mean 'overlap_comm'" in str(err.value)


def test_offload_param_below_stage_3_is_ignored_with_a_warning() -> None:
    t = read({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert not t.value.offload.parameters.enabled
    entry = t.report.find("zero_optimization.offload_param.device")
    assert entry.status is Status.IGNORED and entry in t.report.approximations


def test_offload_tiers_and_nvme() -> None:
    t = read({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 6,
                                                          "pipeline_read": True, "ratio": 0.5},
                                    "offload_param": {"device": "cpu", "pin_memory": False}}})
    o = t.value.offload
    assert (o.optimizer.device.value, o.optimizer.nvme_path, o.optimizer.buffer_count) == ("nvme", "/nvme", 6)
    assert o.optimizer.ratio == 0.5 and o.optimizer.pipeline_read and o.sub_group_size == 100_000_000
    assert (o.parameters.device.value, o.parameters.pin_memory) == ("cpu", False)
    back = read(write_deepspeed(t.value).value)
    assert back.value == t.value


@pytest.mark.parametrize("fp16, expected", [
    ({"enabled": True}, ("dynamic", 2.0**16, 1000, 2, 1.0)),
    ({"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": 8},
     ("dynamic", 2.0**12, 500, 4, 8.0)),
])
def test_dynamic_loss_scaling(fp16: dict[str, Any], expected: tuple[Any, ...]) -> None:
    ls = read({"fp16": fp16}).value.precision.loss_scaling
    assert (ls.kind, ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale) == expected


def test_static_loss_scale_and_precision_dtypes() -> None:
    t = read({"fp16": {"enabled": True, "loss_scale": 128}, "communication_data_type": "fp32",
              "data_types": {"grad_accum_dtype": "fp32"}})
    p = t.value.precision
    assert p.loss_scaling.kind == "static" and p.loss_scaling.scale == 128
    assert (p.param_dtype, p.master_dtype, p.reduce_dtype, p.accumulate_dtype) == (
        DType.FP16, DType.FP32, DType.FP32, DType.FP32)
    assert p.skip_nonfinite_steps  # DeepSpeed fp16 always skips overflowing steps


def test_bf16_master_weights_and_overflow_check() -> None:
    p = read({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                       "check_grad_overflow": False}}).value.precision
    assert p.master_dtype is DType.BF16 and not p.skip_nonfinite_steps


def test_hpz_and_legacy_mics() -> None:
    t = read({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert t.value.sharding.backward_gather_group == 8
    t = read({"zero_optimization": {"stage": 3, "mics_shard_size": 4}})
    assert t.value.sharding.shard_group == 4 and t.value.sharding.is_hybrid
    out = write_deepspeed(t.value)
    assert "mics_shard_size" not in out.value["zero_optimization"]  # removed in DeepSpeed 0.19.8
    assert out.report.find("sharding.shard_group").status is Status.APPROXIMATED


def test_writer_states_defaults_that_moved_between_releases() -> None:
    spec = StrategySpec.model_validate({"sharding": {"optimizer_state": True, "gradients": True,
                                                     "parameters": "reshard_after_forward"},
                                        "offload": {"optimizer": {"device": "cpu", "pin_memory": False}}})
    out = write_deepspeed(spec).value
    assert out["gradient_clipping"] == 0.0  # no clipping, stated: DeepSpeed's own default is 1.0
    assert out["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert out["zero_optimization"]["overlap_comm"] is True
    assert out["communication_data_type"] == "fp32"


def test_shard_grad_op_becomes_stage_2_approximated() -> None:
    spec = StrategySpec.model_validate({"sharding": {"optimizer_state": True, "gradients": True,
                                                     "parameters": "reshard_after_backward"}})
    t = write_deepspeed(spec)
    assert t.value["zero_optimization"]["stage"] == 2
    entry = t.report.find("sharding.parameters")
    assert entry.status is Status.APPROXIMATED and "full parameters" in entry.note


_stages = st.sampled_from([0, 1, 2, 3])
_sizes = st.one_of(st.integers(0, 10**10), st.just("auto"))


@st.composite
def deepspeed_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Random valid DeepSpeed configs over the keys zerobridge maps."""
    stage = draw(_stages)
    zero: dict[str, Any] = {"stage": stage}
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if draw(st.booleans()):
            zero[key] = draw(_sizes)
    for key in ("allgather_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "sub_group_size"):
        if draw(st.booleans()):
            zero[key] = draw(st.integers(0, 10**10))
    if draw(st.booleans()):
        zero["overlap_comm"] = draw(st.booleans())
    if stage >= 1 and draw(st.booleans()):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": draw(st.booleans())}
    if stage == 3 and draw(st.booleans()):
        zero["offload_param"] = {"device": "nvme", "nvme_path": "/nvme", "buffer_count": draw(st.integers(1, 9))}
    if stage == 3 and draw(st.booleans()):
        zero["zero_hpz_partition_size"] = draw(st.sampled_from([1, 2, 8]))
    if stage == 3 and draw(st.booleans()):
        zero["stage3_gather_16bit_weights_on_model_save"] = draw(st.sampled_from([True, False, "auto"]))
    config: dict[str, Any] = {"zero_optimization": zero}
    mode = draw(st.sampled_from(["fp32", "fp16", "bf16", "auto"]))
    if mode == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": draw(st.integers(0, 32)),
                          "loss_scale_window": draw(st.integers(1, 5000)), "hysteresis": draw(st.integers(1, 8))}
    elif mode == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": draw(st.booleans())}
    elif mode == "auto":
        config["bf16"] = {"enabled": "auto"}
        config["fp16"] = {"enabled": draw(st.sampled_from(["auto", False]))}
    if draw(st.booleans()):
        config["communication_data_type"] = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    micro, gas = draw(st.integers(1, 64)), draw(st.integers(1, 16))
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas,
                  gradient_clipping=draw(st.sampled_from([0.0, 0.5, 1.0, "auto"])))
    if draw(st.booleans()):
        config["optimizer"] = {"type": "AdamW", "params": {"lr": draw(st.floats(1e-6, 1e-2))}}
    return config


@settings(max_examples=150, deadline=None)
@given(deepspeed_configs())
def test_round_trip_is_stable(config: dict[str, Any]) -> None:
    spec = read(config).value
    written = write_deepspeed(spec).value
    again = read(written).value
    assert again == spec
    assert write_deepspeed(again).value == written
    json.dumps(written)  # plain JSON


# --- "auto" comes back as exactly the keys the source had ------------------------------------------------


def _auto_keys(config: dict[str, Any], prefix: str = "") -> set[str]:
    """Canonical dotted paths whose value is "auto" (aliases folded through the mapping table)."""
    from zerobridge.translate.mapping import load_table

    table, found = load_table("deepspeed"), set()
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            found |= _auto_keys(value, f"{path}.")
        elif value == "auto":
            row = table.find(path)
            found.add(row.path if row is not None else path)
    return found


@pytest.mark.parametrize("source, autos", [
    ({"fp16": {"enabled": "auto"}}, {"fp16.enabled"}),
    ({"bf16": {"enabled": "auto"}}, {"bf16.enabled"}),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, {"fp16.enabled", "bf16.enabled"}),
    ({"fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": False}}, {"fp16.enabled"}),
])
def test_auto_precision_comes_back_as_the_sections_the_source_had(source: dict[str, Any], autos: set[str]) -> None:
    """An "auto" section the source never had would let HF Trainer's --bf16 (or --fp16) switch it on."""
    spec = read_deepspeed(Located({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
                                   **source}, "ds.json")).value
    written = write_deepspeed(spec).value
    assert _auto_keys(written) == autos
    again = write_deepspeed(read_deepspeed(Located(written, "again.json")).value).value
    assert again == written


@pytest.mark.corpus
@pytest.mark.parametrize("path", corpus_files("deepspeed"), ids=lambda p: p.name)
def test_corpus_keeps_its_set_of_auto_keys(path: Path) -> None:
    source = parse_json(read_file_text(path), str(path))
    written = write_deepspeed(read_deepspeed(source).value).value
    carried = {"optimizer", "scheduler"}  # carried verbatim, "auto" and all
    expected = {k for k in _auto_keys(source.data) if k.split(".")[0] not in carried}
    if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(source.data):
        expected.add("train_micro_batch_size_per_gpu")  # DeepSpeed needs one; "auto" lets Trainer fill it
    assert {k for k in _auto_keys(written) if k.split(".")[0] not in carried} == expected
