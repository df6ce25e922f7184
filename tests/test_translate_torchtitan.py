"""torchtitan job config (TOML) -> spec: the public corpus and fixtures written here. No process group."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, ParamSharding, Stage, StrategySpec
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.translate.report import Status, Translation
from zerobridge.translate.sources import parse_toml
from zerobridge.translate.torchtitan import read_torchtitan


def corpus_root() -> Path | None:
    env = os.environ.get("ZEROBRIDGE_CORPUS")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "corpus"
    return root if root.is_dir() else None


CORPUS = corpus_root()
FILES = sorted((CORPUS / "torchtitan").glob("*.toml")) if CORPUS else []
needs_corpus = pytest.mark.skipif(CORPUS is None, reason="no shared/corpus (set ZEROBRIDGE_CORPUS)")
PREFIX = "pytorch__torchtitan__torchtitan__models__llama3__train_configs__"


def read(text: str, **kw: Any) -> Translation[StrategySpec]:
    return read_torchtitan(parse_toml(text, "job.toml"), **kw)


def corpus(name: str, **kw: Any) -> Translation[StrategySpec]:
    assert CORPUS is not None
    path = CORPUS / "torchtitan" / f"{PREFIX}{name}.toml"
    return read_torchtitan(parse_toml(path.read_text(), str(path)), **kw)


@needs_corpus
@pytest.mark.corpus
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem.split("__")[-1])
def test_every_corpus_file_reads(path: Path) -> None:
    t = read_torchtitan(parse_toml(path.read_text(), str(path)))
    assert t.report.entries and t.value.sharding.stage == Stage.PARAMETERS
    assert "optimizer" in t.value.passthrough["torchtitan"]


@needs_corpus
def test_llama3_8b() -> None:
    t = corpus("llama3_8b")
    s = t.value
    assert s.sharding.shard_group == "world" and s.sharding.parameters == ParamSharding.RESHARD_AFTER_FORWARD
    assert s.sharding.world_size is None  # -1 and no world size given
    p = s.precision
    assert (p.param_dtype, p.reduce_dtype, p.master_dtype) == (DType.BF16, DType.FP32, DType.FP32)
    assert s.batch.clip_grad_norm == 1.0 and s.batch.micro_batch_size == 1  # old name batch_size
    assert s.checkpoint.activation_checkpointing and s.checkpoint.format == CheckpointFormat.SHARDED
    assert s.wrapping.policy == "transformer"
    assert t.report.find("activation_checkpoint.mode").status is Status.APPROXIMATED  # selective
    assert t.value.passthrough["torchtitan"]["model"]["flavor"] == "8B"
    sized = corpus("llama3_8b", world_size=64).value
    assert sized.sharding.world_size == 64 and sized.batch.global_batch_size == 64


@needs_corpus
def test_llama3_70b_tensor_parallel() -> None:
    t = corpus("llama3_70b", world_size=64)
    assert t.value.sharding.world_size == 8  # 64 ranks / 8-way TP
    assert t.report.find("parallelism.tensor_parallel_degree").status is Status.NOT_EXPRESSIBLE
    assert t.value.checkpoint.activation_checkpointing  # mode full
    with pytest.raises(ConfigError, match="multiple"):
        corpus("llama3_70b", world_size=60)


HSDP = """
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 4
fsdp_reshard_after_forward = "{policy}"
pipeline_parallel_degree = {pp}
[training]
local_batch_size = 2
global_batch_size = {gbs}
enable_cpu_offload = {offload}
[activation_checkpoint]
mode = "none"
"""


def hsdp(policy: str = "default", pp: int = 1, gbs: int = -1, offload: str = "false") -> Translation[StrategySpec]:
    return read(HSDP.format(policy=policy, pp=pp, gbs=gbs, offload=offload))


def test_hsdp_is_hybrid_with_a_mics_note() -> None:
    t = hsdp()
    s = t.value.sharding
    assert (s.shard_group, s.world_size, s.is_hybrid) == (4, 8, True)
    assert "MiCS" in t.report.find("parallelism.data_parallel_replicate_degree").note
    assert not t.value.checkpoint.activation_checkpointing


@pytest.mark.parametrize("policy, pp, parameters", [
    ("default", 1, ParamSharding.RESHARD_AFTER_FORWARD), ("default", 2, ParamSharding.RESHARD_AFTER_BACKWARD),
    ("always", 2, ParamSharding.RESHARD_AFTER_FORWARD), ("never", 1, ParamSharding.RESHARD_AFTER_BACKWARD)])
def test_reshard_policy(policy: str, pp: int, parameters: ParamSharding) -> None:
    t = hsdp(policy, pp)
    assert t.value.sharding.parameters == parameters
    if pp > 1:
        assert t.report.find("parallelism.pipeline_parallel_degree").status is Status.NOT_EXPRESSIBLE


def test_global_batch_gives_accumulation_and_offload() -> None:
    s = hsdp(gbs=64, offload="true").value
    assert (s.batch.micro_batch_size, s.batch.accumulation_steps, s.batch.global_batch_size) == (2, 4, 64)
    assert s.offload.parameters.device.value == s.offload.optimizer.device.value == "cpu"
    with pytest.raises(ConfigError, match="global_batch_size"):
        hsdp(gbs=30)
    unknown = read("[training]\nglobal_batch_size = 64\n").value
    assert unknown.batch.accumulation_steps is None and unknown.batch.global_batch_size == 64  # derived at run time


def test_ddp_and_single_rank() -> None:
    s = read("[parallelism]\ndata_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1\n").value
    assert s.sharding.stage == Stage.NONE and s.sharding.world_size == 4
    assert (s.precision.param_dtype, s.precision.reduce_dtype) == (DType.BF16, DType.FP32)
    one = read("[parallelism]\ndata_parallel_shard_degree = 1\n[training]\nmixed_precision_param = 'float32'\n")
    assert one.value.sharding.world_size == 1 and one.value.precision.param_dtype == DType.FP32


def test_unknown_parallelism_key_and_bad_values() -> None:
    with pytest.raises(ConfigError) as err:
        read("[parallelism]\ndata_parallel_shard_degre = 4\n")
    assert "data_parallel_shard_degree" in str(err.value) and "job.toml:2" in str(err.value)
    with pytest.raises(ConfigError, match="one of"):
        read("[parallelism]\nfsdp_reshard_after_forward = 'sometimes'\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read("[parallelism\n")
    carried = read("[training]\nmy_new_knob = 3\n[brand_new]\nx = 1\n")
    assert carried.value.passthrough["torchtitan"] == {"training": {"my_new_knob": 3}, "brand_new": {"x": 1}}


def test_float8_all_gather_is_the_fp8_wire_format_in_both_sections() -> None:
    t = read("[float8]\nenable_fsdp_float8_all_gather = true\n")
    assert t.report.find("float8.enable_fsdp_float8_all_gather").status is Status.APPROXIMATED  # scale granularity
    assert t.value.communication.wire.param_gather.value == "fp8"
    new = read("[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\nrecipe_name = \"rowwise\"\n")
    assert new.value.communication.wire.param_gather.value == "fp8"
    assert new.value.passthrough["torchtitan"]["quantize"] == {"linear": {"float8": {"recipe_name": "rowwise"}}}
    off = read("[float8]\nenable_fsdp_float8_all_gather = false\n")
    assert off.report.find("float8.enable_fsdp_float8_all_gather").status is Status.EXACT
    assert off.value.communication.wire.param_gather.value == "full"
    ddp = read("[parallelism]\ndata_parallel_shard_degree = 1\n[float8]\nenable_fsdp_float8_all_gather = true\n")
    assert ddp.report.find("float8.enable_fsdp_float8_all_gather").status is Status.IGNORED
    assert ddp.value.communication.wire.param_gather.value == "full"
