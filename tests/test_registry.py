"""The strategy registry: every entry loads, names resolve, each means what its flavor does."""

from __future__ import annotations

import pytest

from zerobridge.errors import ConfigError
from zerobridge.registry import ACCELERATE_CODES, names, resolve, strategies
from zerobridge.spec import ParamSharding, Stage

REQUIRED = ["zero0", "zero1", "zero2", "zero3", "zero1-offload", "zero2-offload", "zero3-offload-optimizer",
            "zero3-offload-param", "zero3-offload", "zero-infinity", "fsdp-full-shard", "fsdp-shard-grad-op",
            "fsdp-no-shard", "fsdp-hybrid-shard", "fsdp-hybrid-shard-zero2", "fsdp2", "fsdp2-no-reshard",
            "fsdp2-reshard-8", "mics", "zero3-hpz"]


def test_every_required_strategy_is_registered() -> None:
    assert set(REQUIRED) <= {s.name for s in strategies()}


@pytest.mark.parametrize("name", REQUIRED)
def test_each_entry_reads(name: str) -> None:
    spec = resolve(name).value
    assert spec.name == name


@pytest.mark.parametrize("name, stage, params", [
    ("zero1", Stage.OPTIMIZER, ParamSharding.REPLICATED),
    ("zero2", Stage.GRADIENTS, ParamSharding.REPLICATED),
    ("zero3", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_FORWARD),
    ("fsdp:FULL_SHARD", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_FORWARD),
    ("fsdp:SHARD_GRAD_OP", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_BACKWARD),
    ("fsdp2:false", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_BACKWARD),
    ("2", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_BACKWARD),
    ("deepspeed_stage_2_offload", Stage.GRADIENTS, ParamSharding.REPLICATED),
    ("lightning:deepspeed_stage_3_offload_nvme", Stage.PARAMETERS, ParamSharding.RESHARD_AFTER_FORWARD),
])
def test_names_users_type(name: str, stage: Stage, params: ParamSharding) -> None:
    spec = resolve(name).value
    assert spec.sharding.stage is stage and spec.sharding.parameters is params


def test_flavor_defaults_are_kept() -> None:
    zero3, full_shard = resolve("zero3").value, resolve("fsdp-full-shard").value
    # a name states how state is sharded; batch, accumulation, clipping and precision are the script's
    for spec in (zero3, full_shard):
        assert spec.batch.clip_grad_norm == spec.batch.accumulation_steps == spec.precision.param_dtype == "auto"
    assert "--max_grad_norm" in resolve("zero3").report.find("batch.clip_grad_norm").note
    assert zero3.communication.persistence_threshold == 100_000
    assert full_shard.communication.persistence_threshold == 0
    nvme = resolve("deepspeed_stage_3_offload_nvme").value
    assert nvme.offload.optimizer.device.value == "nvme" and nvme.offload.parameters.device.value == "nvme"


def test_hybrid_and_hpz_entries() -> None:
    assert resolve("fsdp-hybrid-shard").value.sharding.shard_group == "node"
    assert resolve("fsdp2-reshard-8").value.sharding.backward_gather_group == 8
    assert resolve("zero3-hpz").value.sharding.backward_gather_group == 8
    assert resolve("mics").value.sharding.shard_group == 8


def test_accelerate_codes_and_names_are_unique() -> None:
    assert set(ACCELERATE_CODES) == {"1", "2", "3", "4", "5"}
    listed = names()
    assert len(listed) == len(set(listed))


def test_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'zero3-offload'"):
        resolve("zero3-ofload")
