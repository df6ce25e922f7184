"""The spec alone: validation, canonical form, the stage table. No process group."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from zerobridge.spec import (
    STAGE_SHARDS,
    BatchSpec,
    DType,
    ParamSharding,
    PrecisionSpec,
    ShardingSpec,
    Stage,
    StrategySpec,
)


@pytest.mark.parametrize("stage", list(Stage))
def test_for_stage_matches_the_table_and_round_trips(stage: Stage) -> None:
    sharding = ShardingSpec.for_stage(stage)
    row = STAGE_SHARDS[stage]
    assert (sharding.optimizer_state, sharding.gradients, sharding.parameters) == tuple(row)
    assert sharding.stage is stage
    spec = StrategySpec(sharding=sharding)
    assert StrategySpec.model_validate(spec.dump()) == spec


def test_shard_grad_op_is_stage_3_at_rest() -> None:
    s = ShardingSpec.for_stage(3, parameters="reshard_after_backward")
    assert s.stage is Stage.PARAMETERS and s.parameters is ParamSharding.RESHARD_AFTER_BACKWARD


@pytest.mark.parametrize("fields, message", [
    ({"gradients": True}, "needs sharding.optimizer_state"),
    ({"optimizer_state": True, "parameters": "reshard_after_forward"}, "needs sharding.gradients"),
    ({"optimizer_state": True, "gradients": True, "parameters": "reshard_after_backward",
      "backward_gather_group": 8}, "backward_gather_group needs"),
    ({"optimizer_state": True, "gradients": True, "parameters": "reshard_after_forward", "shard_group": 3,
      "world_size": 8}, "does not divide the world size 8"),
    ({"optimizer_state": True, "gradients": True, "parameters": "reshard_after_forward", "shard_group": 8,
      "backward_gather_group": 3}, "does not divide shard_group"),
])
def test_contradictions_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ShardingSpec.model_validate(fields)


def test_models_are_frozen_and_closed() -> None:
    spec = StrategySpec()
    with pytest.raises(ValidationError):
        spec.sharding.optimizer_state = True  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs"):
        StrategySpec.model_validate({"sharding": {"stagee": 3}})


def test_reduce_and_accumulate_dtypes_default_to_the_compute_dtype() -> None:
    p = PrecisionSpec(param_dtype="bf16")
    assert (p.reduce_dtype, p.accumulate_dtype, p.master_dtype) == (DType.BF16, DType.BF16, DType.FP32)
    assert p.mixed
    assert PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32").reduce_dtype is DType.FP32


@pytest.mark.parametrize("fields, message", [
    ({"param_dtype": "bf16", "loss_scaling": {"kind": "dynamic"}}, "loss scaling only applies to fp16"),
    ({"param_dtype": "bf16", "master_dtype": "fp16"}, "either fp32 or the compute dtype"),
])
def test_precision_contradictions(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PrecisionSpec.model_validate(fields)


def test_batch_identity() -> None:
    with pytest.raises(ValidationError, match="not a multiple of"):
        BatchSpec(micro_batch_size=4, accumulation_steps=3, global_batch_size=16)
    b = BatchSpec(micro_batch_size=4, accumulation_steps=2, global_batch_size=64)
    assert b.resolve_global_batch(8) == 64
    with pytest.raises(ValueError, match="run on 8 ranks"):
        b.resolve_global_batch(4)


@pytest.mark.parametrize("fields, message", [
    ({"offload": {"parameters": {"device": "cpu"}}}, "needs parameters sharded at rest"),
    ({"offload": {"optimizer": {"device": "cpu"}}}, "needs sharding.optimizer_state"),
    ({"offload": {"optimizer": {"device": "nvme"}}, "sharding": {"optimizer_state": True}}, "needs nvme_path"),
])
def test_offload_needs_the_right_sharding(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StrategySpec.model_validate(fields)
