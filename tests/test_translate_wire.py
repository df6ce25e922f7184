"""Quantized collectives in every format: ZeRO++ keys, float8 all-gather, and the formats without a form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.translate.formats import read, read_file, write
from zerobridge.translate.report import Status
from zerobridge.translate.sources import Located

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def ds(stage: int, **zero: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, **zero}}


def spec(stage: int = 3, **wire: str) -> StrategySpec:
    data = spec_for_stage(stage).model_dump(mode="json")
    data["communication"]["wire"] = wire
    return StrategySpec.model_validate(data)


def statuses(report: Any, prefix: str) -> dict[str, str]:
    return {e.key: e.status.value for e in report.entries if e.key.startswith(prefix)}


def test_zeropp_keys_read_exact_and_round_trip() -> None:
    source = ds(3, zero_quantized_weights=True, zero_quantized_gradients=True,
                zero_quantized_nontrainable_weights=True, zero_hpz_partition_size=8)
    t = read(Located(source, "ds.json"), "deepspeed")
    wire = t.value.communication.wire
    assert (wire.param_gather.value, wire.grad_reduce.value, wire.frozen_weights.value) == ("int8", "int4", "int8")
    assert set(statuses(t.report, "zero_optimization.zero_quantized").values()) == {"exact"}
    back = write(t.value, "deepspeed")
    zero = back.value["zero_optimization"]
    assert zero["zero_quantized_weights"] and zero["zero_quantized_gradients"]
    assert zero["zero_quantized_nontrainable_weights"] and zero["zero_hpz_partition_size"] == 8
    assert set(statuses(back.report, "communication.wire").values()) == {"exact"}


def test_deepspeed_ignores_zeropp_below_stage_3_and_we_say_so() -> None:
    t = read(Located(ds(2, zero_quantized_gradients=True, zero_quantized_weights=True), "ds.json"), "deepspeed")
    assert not t.value.communication.wire.quantized
    assert set(statuses(t.report, "zero_optimization.zero_quantized").values()) == {"ignored"}
    w = write(spec(2, grad_reduce="int8"), "deepspeed")
    assert "zero_quantized_gradients" not in w.value["zero_optimization"]
    assert statuses(w.report, "communication.wire") == {"communication.wire.grad_reduce": "not_expressible"}


def test_other_schemes_are_approximated_for_deepspeed_and_validate() -> None:
    from deepspeed.runtime import config as deepspeed_config

    w = write(spec(param_gather="fp8", grad_reduce="int8"), "deepspeed")
    assert statuses(w.report, "communication.wire") == {"communication.wire.param_gather": "approximated",
                                                        "communication.wire.grad_reduce": "approximated"}
    assert "different scheme with the same bytes" in w.report.find("communication.wire.param_gather").note
    config = {k: v for k, v in w.value.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    checked = deepspeed_config.DeepSpeedConfig({**config, "train_micro_batch_size_per_gpu": 1})
    assert checked.zero_config.zero_quantized_weights and checked.zero_config.zero_quantized_gradients


@pytest.mark.parametrize(("target", "status"), [("fsdp2", "not_expressible"), ("fsdp1", "not_expressible"),
                                                ("lightning", "not_expressible"),
                                                ("accelerate-deepspeed", "not_expressible"),
                                                ("accelerate-fsdp", "not_expressible")])
def test_formats_without_a_form_report_every_quantized_payload(target: str, status: str) -> None:
    w = write(spec(param_gather="int8", grad_reduce="int4"), target)
    found = statuses(w.report, "communication.wire")
    assert found == {"communication.wire.param_gather": status, "communication.wire.grad_reduce": status}


def test_fsdp2_names_the_torchao_recipe_and_accelerate_round_trips_float8() -> None:
    w = write(spec(param_gather="fp8"), "fsdp2")
    assert "convert_to_float8_training" in w.report.find("communication.wire.param_gather").note
    yaml = {"distributed_type": "FSDP", "mixed_precision": "fp8", "num_processes": 8,
            "fp8_config": {"backend": "AO", "enable_fsdp_float8_all_gather": True},
            "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}
    t = read(Located(yaml, "fsdp.yaml"), "accelerate")
    assert t.value.communication.wire.param_gather.value == "fp8"
    assert t.report.find("fp8_config.enable_fsdp_float8_all_gather").status is Status.APPROXIMATED  # scales
    back = write(t.value, "accelerate-fsdp")
    assert back.value["mixed_precision"] == "fp8" and back.value["fp8_config"]["enable_fsdp_float8_all_gather"]
    assert statuses(back.report, "communication.wire") == {"communication.wire.param_gather": "approximated"}


def test_backends_refuse_what_they_cannot_run() -> None:
    from zerobridge.backends.deepspeed.config import build_config
    from zerobridge.backends.fsdp.assess import assess, refuse

    with pytest.raises(ConfigError, match="CUDA-only"):
        build_config(spec(param_gather="int8"), world_size=2)
    assessment = assess(spec(param_gather="fp8"), world_size=2, local_world_size=2)
    with pytest.raises(ConfigError, match="convert_to_float8_training"):
        refuse(assessment.approximations)


@pytest.mark.skipif(not CORPUS.is_dir(), reason="needs ../shared/corpus")
def test_corpus_zeropp_and_float8_configs_read_the_new_fields() -> None:
    quant = read_file(CORPUS / "deepspeed" /
                      "hiyouga__LLaMA-Factory__examples__deepspeed__hparam_sweep__ds_z3_e9_quant_grads.json")
    assert quant.value.communication.wire.grad_reduce.value == "int4"
    assert quant.report.find("zero_optimization.zero_quantized_gradients").status is Status.EXACT
    titan = read_file(CORPUS / "torchtitan" / "pytorch__torchtitan__torchtitan__models__llama3__train_configs__"
                                              "llama3_405b.toml")
    assert titan.value.communication.wire.param_gather.value == "fp8"
    assert titan.report.find("float8.enable_fsdp_float8_all_gather").status is Status.APPROXIMATED
