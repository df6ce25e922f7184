"""PyTorch Lightning strategy names <-> spec. No process group, no Lightning install needed."""

from __future__ import annotations

from typing import Any

import pytest

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, ParamSharding, Stage, StrategySpec
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.lightning import lightning_names, read_lightning, write_lightning
from zerobridge.translate.report import Status
from zerobridge.translate.sources import Located

STAGES = {"ddp": 0, "deepspeed": 2, "deepspeed_stage_1": 1, "deepspeed_stage_1_offload": 1,
          "deepspeed_stage_2": 2, "deepspeed_stage_2_offload": 2, "deepspeed_stage_3": 3,
          "deepspeed_stage_3_offload": 3, "deepspeed_stage_3_offload_nvme": 3, "fsdp": 3, "fsdp_cpu_offload": 3}


def test_registry_names() -> None:
    assert sorted(lightning_names()) == sorted(STAGES)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_name_reads_and_writes_back_to_itself(name: str) -> None:
    t = read_lightning(name)
    assert t.value.sharding.stage == Stage(STAGES[name])
    assert t.report.find("strategy") is not None
    back = write_lightning(t.value)
    assert back.report.exact, back.report.render()
    assert read_lightning(back.value["strategy"], **back.value["kwargs"], **back.value["trainer"]).value == t.value
    if name != "deepspeed_stage_1_offload":  # Fabric-only: written as deepspeed_stage_1 + offload_optimizer
        expected = "deepspeed_stage_2" if name == "deepspeed" else name
        assert back.value["strategy"] == expected and back.value["kwargs"] == {}


def test_stage_2_offload_carries_lightning_defaults() -> None:
    s = read_lightning("deepspeed_stage_2_offload").value
    assert s.sharding.stage == Stage.GRADIENTS and s.sharding.parameters == ParamSharding.REPLICATED
    assert s.offload.optimizer.device.value == "cpu" and not s.offload.parameters.enabled
    assert s.offload.optimizer.pin_memory is False  # Lightning's default, DeepSpeed's is True
    assert s.communication.reduce_bucket == s.communication.allgather_bucket == 200_000_000
    assert s.communication.overlap_reduce is True  # Lightning turns it on below stage 3 too
    assert s.offload.sub_group_size == 10**12
    # Trainer(gradient_clip_val=...) not given: the name leaves clipping (and accumulation) to the script
    assert s.batch.clip_grad_norm == s.batch.accumulation_steps == "auto"
    assert read_lightning("deepspeed_stage_2_offload", gradient_clip_val=0).value.batch.clip_grad_norm is None


def test_nvme_name_and_fabric_only_name() -> None:
    s = read_lightning("deepspeed_stage_3_offload_nvme").value
    assert s.offload.optimizer.device.value == s.offload.parameters.device.value == "nvme"
    assert s.offload.parameters.nvme_path == "/local_nvme"
    t = read_lightning("deepspeed_stage_1_offload")
    assert "lightning.pytorch" in t.report.find("strategy").note
    assert "lightning.pytorch" not in read_lightning("deepspeed_stage_1_offload", fabric=True).report.find(
        "strategy").note


def test_prefix_and_unknown_names() -> None:
    assert read_lightning("lightning:deepspeed_stage_3").value == read_lightning("deepspeed_stage_3").value
    with pytest.raises(ConfigError, match="deepspeed_stage_3"):
        read_lightning("deepspeed_stage3")
    with pytest.raises(ConfigError, match="did you mean 'reduce_bucket_size'"):
        read_lightning("deepspeed", reduce_bucket=5)
    with pytest.raises(ConfigError, match="precision"):
        read_lightning("fsdp", precison="bf16-mixed")


def test_constructor_and_trainer_arguments() -> None:
    s = read_lightning("deepspeed_stage_3", reduce_bucket_size=10**6, pin_memory=True, precision="16-mixed",
                       accumulate_grad_batches=4, gradient_clip_val=0.5).value
    assert s.communication.reduce_bucket == 10**6 and s.precision.param_dtype == DType.FP16
    assert s.precision.loss_scaling.kind == "dynamic" and s.precision.loss_scaling.hysteresis == 2
    assert (s.batch.accumulation_steps, s.batch.clip_grad_norm) == (4, 0.5)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        read_lightning("deepspeed", config={"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2})
    t = read_lightning("deepspeed", config={"zero_optimization": {"stage": 1}}, stage=3)
    assert t.value.sharding.stage == Stage.OPTIMIZER
    assert t.report.find("DeepSpeedStrategy.stage").status is Status.IGNORED


@pytest.mark.parametrize("precision, param, master, reduce", [
    ("32-true", DType.FP32, DType.FP32, DType.FP32), ("bf16-mixed", DType.BF16, DType.FP32, DType.BF16),
    ("bf16-true", DType.BF16, DType.BF16, DType.BF16), ("16-mixed", DType.FP16, DType.FP32, DType.FP16)])
def test_fsdp_precision_comes_from_the_trainer(precision: str, param: DType, master: DType, reduce: DType) -> None:
    p = read_lightning("fsdp", precision=precision).value.precision
    assert (p.param_dtype, p.master_dtype, p.reduce_dtype) == (param, master, reduce)


def test_fsdp_defaults_and_hybrid() -> None:
    s = read_lightning("fsdp").value
    assert s.checkpoint.format == CheckpointFormat.FULL and s.passthrough["fsdp1"]["use_orig_params"] is True
    assert read_lightning("fsdp", fabric=True).value.checkpoint.format == CheckpointFormat.SHARDED
    h = read_lightning("fsdp", sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)).value.sharding
    assert (h.shard_group, h.world_size, h.is_hybrid) == (4, 8, True)
    with pytest.raises(ConfigError, match="device_mesh"):
        read_lightning("fsdp", sharding_strategy="HYBRID_SHARD")


def ds(config: dict[str, Any]) -> StrategySpec:
    return read_deepspeed(Located(config, "ds.json")).value


def test_write_picks_zero3_offload_and_makes_it_exact() -> None:
    spec = ds({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}})
    t = write_lightning(spec)
    v = t.value
    assert (v["strategy"], v["class"]) == ("deepspeed_stage_3_offload", "DeepSpeedStrategy")
    assert v["kwargs"]["pin_memory"] is True and v["kwargs"]["reduce_bucket_size"] == 500_000_000
    assert v["trainer"] == {"precision": "bf16-mixed", "gradient_clip_val": 1.0, "accumulate_grad_batches": 1}
    assert t.report.find("kwargs.pin_memory").status is Status.EXACT
    assert read_lightning(v["strategy"], **v["kwargs"], **v["trainer"]).value.model_dump(
        exclude={"passthrough"}) == spec.model_dump(exclude={"passthrough"})


def test_write_reports_what_no_argument_says() -> None:
    spec = ds({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234}})
    t = write_lightning(spec)
    entry = t.report.find("communication.prefetch_bucket")
    assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE and "config=" in entry.note


def test_write_fsdp_like_spec_picks_fsdp() -> None:
    spec = read_lightning("fsdp", sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={"Block"},
                          state_dict_type="sharded", precision="bf16-mixed").value
    v = write_lightning(spec).value
    assert v["strategy"] == "fsdp" and v["kwargs"]["sharding_strategy"] == "SHARD_GRAD_OP"
    assert v["kwargs"]["auto_wrap_policy"] == ["Block"] and v["trainer"]["precision"] == "bf16-mixed"
