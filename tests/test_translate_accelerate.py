"""HF Accelerate config YAML <-> spec: the public corpus, fixtures written here, round trips,
and Accelerate's own launcher and plugin classes reading what zerobridge writes. No process group."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, ParamSharding, Stage, StrategySpec
from zerobridge.spec.checkpoint import CheckpointFormat
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.accelerate_write import write_accelerate_deepspeed, write_accelerate_fsdp
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.report import Status, Translation
from zerobridge.translate.sources import Located, parse_yaml


def corpus_root() -> Path | None:
    env = os.environ.get("ZEROBRIDGE_CORPUS")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "corpus"
    return root if root.is_dir() else None


CORPUS = corpus_root()
ACCELERATE_FILES = sorted((CORPUS / "accelerate").glob("*.yaml")) if CORPUS else []
needs_corpus = pytest.mark.skipif(CORPUS is None, reason="no shared/corpus (set ZEROBRIDGE_CORPUS)")
DS_TEMPLATE = "huggingface__accelerate__examples__config_yaml_templates__deepspeed.yaml"


def read(text: str, source: str = "accelerate.yaml", **kw: Any) -> Translation[StrategySpec]:
    return read_accelerate(parse_yaml(text, source), **kw)


def read_corpus(name: str, tmp_path: Path) -> Translation[StrategySpec]:
    """A corpus YAML, read where its deepspeed_config_file resolves: the DeepSpeed template names
    ../deepspeed_config_templates/zero_stage1_config.json, so its repository layout is rebuilt."""
    assert CORPUS is not None
    path = CORPUS / "accelerate" / name
    if name != DS_TEMPLATE:
        return read(path.read_text(), str(path))
    yaml_dir = tmp_path / "examples" / "config_yaml_templates"
    json_dir = tmp_path / "examples" / "deepspeed_config_templates"
    yaml_dir.mkdir(parents=True)
    json_dir.mkdir(parents=True)
    shutil.copy(path, yaml_dir / "deepspeed.yaml")
    shutil.copy(CORPUS / "deepspeed" / "huggingface__accelerate__examples__deepspeed_config_templates__"
                "zero_stage1_config.json", json_dir / "zero_stage1_config.json")
    return read((yaml_dir / "deepspeed.yaml").read_text(), str(yaml_dir / "deepspeed.yaml"))


def status(t: Translation[Any], key: str) -> Status:
    entry = t.report.find(key)
    assert entry is not None, f"{key} not in report:\n{t.report.render()}"
    return entry.status


# ---------------------------------------------------------------------------------------------- corpus

@needs_corpus
@pytest.mark.corpus
@pytest.mark.parametrize("path", ACCELERATE_FILES, ids=lambda p: p.name.split("__")[-1])
def test_every_corpus_file_reads_and_converts(path: Path, tmp_path: Path) -> None:
    t = read_corpus(path.name, tmp_path)
    assert t.report.entries and t.report.find("distributed_type") is not None
    fsdp = write_accelerate_fsdp(t.value)
    ds = write_accelerate_deepspeed(t.value)
    for written in (fsdp, ds):
        read_accelerate(Located(written.value, "written.yaml"))
        yaml.safe_load(yaml.safe_dump(written.value))


@needs_corpus
def test_corpus_multi_node_fsdp1(tmp_path: Path) -> None:
    t = read_corpus("hiyouga__LLaMA-Factory__examples__accelerate__fsdp_config_multiple_nodes.yaml", tmp_path)
    s = t.value
    assert s.sharding.stage == Stage.PARAMETERS and s.sharding.parameters == ParamSharding.RESHARD_AFTER_FORWARD
    assert s.sharding.world_size == 16 and s.sharding.shard_group == "world" and not s.sharding.is_hybrid
    assert (s.precision.param_dtype, s.precision.master_dtype, s.precision.reduce_dtype) == (
        DType.BF16, DType.FP32, DType.BF16)
    assert s.communication.backward_prefetch.value == "before_grad"
    assert s.checkpoint.format == CheckpointFormat.FULL
    assert s.passthrough["accelerate"]["main_process_ip"] == "192.168.0.1"


@needs_corpus
def test_corpus_tp_hsdp(tmp_path: Path) -> None:
    t = read_corpus("huggingface__accelerate__examples__torch_native_parallelism__configs__tp_hsdp.yaml", tmp_path)
    s = t.value.sharding
    assert (s.shard_group, s.world_size, s.is_hybrid) == (2, 4, True)
    assert status(t, "parallelism_config.parallelism_config_tp_size") is Status.NOT_EXPRESSIBLE


@needs_corpus
def test_corpus_context_parallel_ranks_join_the_shard_group(tmp_path: Path) -> None:
    t = read_corpus("huggingface__accelerate__examples__torch_native_parallelism__configs__cp.yaml", tmp_path)
    s = t.value.sharding
    assert s.world_size == 8 and s.shard_group in ("world", 8) and not s.is_hybrid  # FSDP over dp_shard x cp
    assert t.value.checkpoint.activation_checkpointing
    assert status(t, "parallelism_config.parallelism_config_cp_size") is Status.NOT_EXPRESSIBLE


@needs_corpus
def test_corpus_deepspeed_zero3_offload(tmp_path: Path) -> None:
    t = read_corpus("huggingface__alignment-handbook__recipes__accelerate_configs__deepspeed_zero3.yaml", tmp_path)
    s = t.value
    assert s.sharding.stage == Stage.PARAMETERS and s.sharding.world_size == 1
    assert s.offload.optimizer.device.value == s.offload.parameters.device.value == "cpu"
    assert s.checkpoint.format == CheckpointFormat.CONSOLIDATED_16BIT
    assert s.precision.param_dtype == DType.BF16 and s.batch.clip_grad_norm == "auto"
    assert s.passthrough["accelerate"]["deepspeed_config"]["zero3_init_flag"] is True


@needs_corpus
def test_corpus_fsdp1_fp16_offload_uses_torch_grad_scaler(tmp_path: Path) -> None:
    s = read_corpus("hiyouga__LLaMA-Factory__examples__accelerate__fsdp_config.yaml", tmp_path).value
    assert s.offload.parameters.device.value == "cpu" and s.offload.optimizer.device.value == "cpu"
    scale = s.precision.loss_scaling
    assert scale.kind == "dynamic" and (scale.growth_interval, scale.hysteresis, scale.min_scale) == (2000, 1, 0.0)
    assert s.precision.skip_nonfinite_steps and s.precision.buffer_dtype == DType.FP16


@needs_corpus
def test_corpus_deepspeed_config_file_template(tmp_path: Path) -> None:
    t = read_corpus(DS_TEMPLATE, tmp_path)
    assert t.value.sharding.stage == Stage.OPTIMIZER and t.value.sharding.world_size == 2
    assert t.value.precision.param_dtype == DType.FP16
    assert t.value.passthrough["deepspeed"]["optimizer"]["type"] == "AdamW"


@needs_corpus
def test_corpus_deepspeed_template_without_its_json_is_an_error() -> None:
    assert CORPUS is not None
    path = CORPUS / "accelerate" / DS_TEMPLATE
    with pytest.raises(ConfigError) as err:
        read(path.read_text(), str(path))
    assert "zero_stage1_config.json" in str(err.value) and DS_TEMPLATE in str(err.value)


@needs_corpus
def test_corpus_sequence_parallel_and_ignored_inline_key(tmp_path: Path) -> None:
    t = read_corpus("huggingface__trl__examples__accelerate_configs__alst_ulysses_4gpu.yaml", tmp_path)
    assert t.value.sharding.world_size == 4
    assert status(t, "parallelism_config.parallelism_config_sp_size") is Status.NOT_EXPRESSIBLE
    assert status(t, "deepspeed_config.seq_parallel_communication_data_type") is Status.IGNORED


# ---------------------------------------------------------------------------------------------- fixtures

FSDP_V1 = """
distributed_type: FSDP
mixed_precision: bf16
num_processes: 8
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
"""
FSDP_V2 = """
distributed_type: FSDP
mixed_precision: bf16
num_processes: 8
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
"""


def fsdp(body: str, *, top: str = "distributed_type: FSDP\nnum_processes: 8\n") -> Translation[StrategySpec]:
    lines = "\n".join(f"  {line}" for line in body.strip().splitlines())
    return read(f"{top}fsdp_config:\n{lines}\n")


def test_v1_and_v2_agree_on_shard_grad_op() -> None:
    v1, v2 = read(FSDP_V1).value, read(FSDP_V2).value
    for s in (v1, v2):
        assert s.sharding.parameters == ParamSharding.RESHARD_AFTER_BACKWARD
        assert s.wrapping.policy == "transformer" and s.wrapping.layer_classes == ("LlamaDecoderLayer",)
        assert s.precision.master_dtype == DType.FP32 and s.precision.reduce_dtype == DType.BF16
    assert v1.precision.buffer_dtype == DType.BF16 and v2.precision.buffer_dtype is None  # FSDP2 has none
    assert v1.checkpoint.format == CheckpointFormat.FULL and v2.checkpoint.format == CheckpointFormat.SHARDED
    assert v1.communication.backward_prefetch.value == "none"  # Accelerate's default, not torch's


@pytest.mark.parametrize("code, name, parameters, hybrid", [
    (1, "FULL_SHARD", ParamSharding.RESHARD_AFTER_FORWARD, False),
    (2, "SHARD_GRAD_OP", ParamSharding.RESHARD_AFTER_BACKWARD, False),
    (3, "NO_SHARD", ParamSharding.REPLICATED, False),
    (4, "HYBRID_SHARD", ParamSharding.RESHARD_AFTER_FORWARD, True),
    (5, "HYBRID_SHARD_ZERO2", ParamSharding.RESHARD_AFTER_BACKWARD, True),
])
def test_every_fsdp1_strategy_by_code_and_name(code: int, name: str, parameters: ParamSharding,
                                               hybrid: bool) -> None:
    top = "distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\n"
    by_code = fsdp(f"fsdp_sharding_strategy: {code}\nfsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", top=top)
    by_name = fsdp(f"fsdp_sharding_strategy: {name}\nfsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", top=top)
    assert by_code.value == by_name.value
    s = by_code.value.sharding
    assert s.parameters == parameters and s.is_hybrid is hybrid and s.world_size == 16
    assert s.shard_group == (8 if hybrid else "world")


def test_hybrid_on_one_machine_is_the_whole_world() -> None:
    t = fsdp("fsdp_sharding_strategy: HYBRID_SHARD\nfsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP")
    assert t.value.sharding.shard_group == 8 and not t.value.sharding.is_hybrid
    assert "whole world" in t.report.find("num_machines").note


def test_hybrid_without_auto_wrap_is_refused() -> None:
    with pytest.raises(ConfigError, match="fsdp_auto_wrap_policy"):
        fsdp("fsdp_sharding_strategy: HYBRID_SHARD")


def test_v1_reads_only_the_sharding_strategy() -> None:
    t = fsdp("fsdp_reshard_after_forward: SHARD_GRAD_OP")  # what `accelerate config` writes for FSDP1
    assert t.value.sharding.parameters == ParamSharding.RESHARD_AFTER_FORWARD  # FULL_SHARD from the launcher
    assert status(t, "fsdp_config.fsdp_reshard_after_forward") is Status.IGNORED
    both = fsdp("fsdp_sharding_strategy: SHARD_GRAD_OP\nfsdp_reshard_after_forward: SHARD_GRAD_OP")
    assert status(both, "fsdp_config.fsdp_reshard_after_forward") is Status.EQUIVALENT


def test_v2_needs_a_boolean_reshard() -> None:
    with pytest.raises(ConfigError) as err:
        fsdp("fsdp_version: 2\nfsdp_reshard_after_forward: FULL_SHARD")
    assert "write true" in str(err.value) and "accelerate.yaml:5" in str(err.value)
    t = fsdp("fsdp_version: 2\nfsdp_sharding_strategy: HYBRID_SHARD")
    assert status(t, "fsdp_config.fsdp_sharding_strategy") is Status.IGNORED
    assert not t.value.sharding.is_hybrid


def test_unprefixed_keys_are_read_like_the_launcher_does() -> None:
    assert fsdp("version: 2\nreshard_after_forward: false").value == fsdp(
        "fsdp_version: 2\nfsdp_reshard_after_forward: false").value


@pytest.mark.parametrize("version", [1, 2])
def test_offload(version: int) -> None:
    s = fsdp(f"fsdp_version: {version}\nfsdp_offload_params: true").value
    assert s.offload.parameters.device.value == s.offload.optimizer.device.value == "cpu"


@pytest.mark.parametrize("mixed, param, reduce, scaled", [
    ("'no'", DType.FP32, DType.FP32, False), ("fp16", DType.FP16, DType.FP16, True),
    ("bf16", DType.BF16, DType.BF16, False), ("fp8", DType.BF16, DType.BF16, False)])
def test_mixed_precision(mixed: str, param: DType, reduce: DType, scaled: bool) -> None:
    t = fsdp("fsdp_version: 2", top=f"distributed_type: FSDP\nmixed_precision: {mixed}\n")
    p = t.value.precision
    assert (p.param_dtype, p.reduce_dtype, p.master_dtype) == (param, reduce, DType.FP32)
    assert (p.loss_scaling.kind == "dynamic") is scaled and p.skip_nonfinite_steps is scaled
    if mixed == "fp8":
        assert status(t, "mixed_precision") is Status.APPROXIMATED


def test_prefetch_defaults_and_the_legacy_key() -> None:
    t = fsdp("fsdp_backward_prefetch_policy: BACKWARD_PRE")
    assert t.value.communication.backward_prefetch.value == "none"
    assert status(t, "fsdp_config.fsdp_backward_prefetch_policy") is Status.IGNORED
    assert fsdp("fsdp_backward_prefetch: 2").value.communication.backward_prefetch.value == "after_grad"


def test_size_wrap_and_cls_without_policy() -> None:
    s = fsdp("fsdp_auto_wrap_policy: SIZE_BASED_WRAP\nfsdp_min_num_params: 1000").value
    assert s.wrapping.policy == "size" and s.wrapping.min_params == 1000
    t = fsdp("fsdp_transformer_layer_cls_to_wrap: BertLayer")
    assert t.value.wrapping.policy == "root"
    assert status(t, "fsdp_config.fsdp_transformer_layer_cls_to_wrap") is Status.IGNORED


def test_cpu_ram_efficient_loading_needs_sync() -> None:
    with pytest.raises(ConfigError, match="sync_module_states"):
        fsdp("fsdp_sync_module_states: false")
    fsdp("fsdp_sync_module_states: false\nfsdp_cpu_ram_efficient_loading: false")


def test_parallelism_sizes_must_match_processes() -> None:
    with pytest.raises(ConfigError, match="num_processes is 8"):
        read("distributed_type: FSDP\nnum_processes: 8\nfsdp_config: {fsdp_version: 2}\n"
             "parallelism_config: {parallelism_config_dp_shard_size: 2, parallelism_config_dp_replicate_size: 2}\n")


def test_unknown_key_names_the_closest() -> None:
    with pytest.raises(ConfigError) as err:
        fsdp("fsdp_offload_param: true")
    assert "fsdp_offload_params" in str(err.value) and "accelerate.yaml:4" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'zero_stage'"):
        read("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stge: 3\n")
    with pytest.raises(ConfigError, match="num_processes"):
        read("distributed_type: FSDP\nnum_process: 8\n")


def test_bad_yaml_names_the_line() -> None:
    with pytest.raises(ConfigError) as err:
        read("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: [1\n")
    assert "accelerate.yaml:4" in str(err.value) or "accelerate.yaml:3" in str(err.value)
    with pytest.raises(ConfigError, match="distributed_type"):
        read("num_processes: 2\n")


def test_ddp_types_are_stage_zero() -> None:
    s = read("distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: bf16\n").value
    assert s.sharding.stage == Stage.NONE and s.sharding.world_size == 4
    assert s.precision.param_dtype == DType.BF16 and s.precision.reduce_dtype == DType.FP32


# ---------------------------------------------------------------------------------------------- DeepSpeed

DS_JSON = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 12345}, "bf16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def test_deepspeed_config_file_relative_to_the_yaml_or_base_dir(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "z3.json").write_text(json.dumps(DS_JSON))
    text = "distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  deepspeed_config_file: ds/z3.json\n"
    (tmp_path / "acc.yaml").write_text(text)
    t = read(text, str(tmp_path / "acc.yaml"))
    s = t.value
    assert s.sharding.stage == Stage.PARAMETERS and s.communication.reduce_bucket == 12345
    assert s.precision.param_dtype == "auto" and s.batch.accumulation_steps == 1  # Accelerate fills 1
    assert s.passthrough["deepspeed"]["optimizer"]["type"] == "AdamW" and s.sharding.world_size == 4
    assert read(text, "elsewhere/acc.yaml", base_dir=tmp_path).value == s


def test_missing_deepspeed_config_file_names_both_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        read("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nope.json\n",
             str(tmp_path / "acc.yaml"))
    assert "acc.yaml:3" in str(err.value) and str(tmp_path / "nope.json") in str(err.value)


@pytest.mark.parametrize("extra", ["  zero_stage: 3\n", "  gradient_clipping: 1.0\n", "mixed_precision: bf16\n"])
def test_inline_keys_next_to_a_file_are_refused(tmp_path: Path, extra: str) -> None:
    (tmp_path / "z3.json").write_text(json.dumps(DS_JSON))
    text = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: z3.json\n"
    text = text + extra if extra.startswith("  ") else extra + text
    with pytest.raises(ConfigError, match="cannot be set next to deepspeed_config_file"):
        read(text, str(tmp_path / "acc.yaml"))


def test_inline_deepspeed_is_the_json_accelerate_builds() -> None:
    t = read("distributed_type: DEEPSPEED\nmixed_precision: fp16\nnum_processes: 2\ndeepspeed_config:\n"
             "  offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: /nvme\n"
             "  deepspeed_moe_layer_cls_names: MixtralSparseMoeBlock\n  gradient_clipping: 0\n")
    s = t.value
    assert s.sharding.stage == Stage.GRADIENTS  # Accelerate's default stage
    assert s.offload.optimizer.device.value == "nvme" and s.offload.optimizer.nvme_path == "/nvme"
    assert s.wrapping.policy == "root"  # leaf modules only matter to stage-3 gathering
    assert "unused below stage 3" in t.report.find("deepspeed_config.deepspeed_moe_layer_cls_names").note
    assert s.precision.loss_scaling.kind == "dynamic" and s.precision.loss_scaling.hysteresis == 2  # DeepSpeed's
    assert s.batch.clip_grad_norm == 1.0  # a zero clip is dropped, DeepSpeed's default applies
    assert status(t, "deepspeed_config.gradient_clipping") is Status.IGNORED
    with pytest.raises(ConfigError, match="nvme_path"):
        read("distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: nvme\n  zero_stage: 3\n")


def test_fsdp_section_under_deepspeed_is_ignored() -> None:
    t = read("distributed_type: DEEPSPEED\nfsdp_config:\n  fsdp_offload_params: true\n")
    assert status(t, "fsdp_config.fsdp_offload_params") is Status.IGNORED
    assert not t.value.offload.parameters.enabled


# ---------------------------------------------------------------------------------------------- writing

def test_write_v1_emits_both_strategy_keys() -> None:
    spec = read(FSDP_V2).value
    out = write_accelerate_fsdp(spec, fsdp_version=1).value["fsdp_config"]
    assert out["fsdp_sharding_strategy"] == out["fsdp_reshard_after_forward"] == "SHARD_GRAD_OP"


def test_write_hybrid_both_ways() -> None:
    spec = fsdp("fsdp_sharding_strategy: HYBRID_SHARD\nfsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                top="distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\n").value
    v2 = write_accelerate_fsdp(spec).value
    assert v2["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                        "parallelism_config_dp_shard_size": 8}
    v1 = write_accelerate_fsdp(spec, fsdp_version=1).value
    assert v1["num_machines"] == 2 and v1["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD"
    for out in (v1, v2):
        assert read_accelerate(Located(out, "w.yaml")).value.sharding == spec.sharding


def test_write_stage_zero_as_fsdp2_is_ddp() -> None:
    out = write_accelerate_fsdp(StrategySpec()).value
    assert out["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in out


def test_write_deepspeed_inline_reports_what_it_cannot_carry() -> None:
    spec = read_deepspeed(Located({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                         "offload_optimizer": {"device": "cpu"}},
                                   "gradient_clipping": 0.5, "bf16": {"enabled": True}}, "ds.json")).value
    t = write_accelerate_deepspeed(spec)
    ds = t.value["deepspeed_config"]
    assert (ds["zero_stage"], ds["offload_optimizer_device"], ds["gradient_clipping"]) == (3, "cpu", 0.5)
    assert t.value["mixed_precision"] == "bf16"
    entry = t.report.find("communication.reduce_bucket")
    assert entry.status is Status.NOT_EXPRESSIBLE and "deepspeed_config_file" in entry.note
    assert read_accelerate(Located(t.value, "w.yaml")).value.offload == spec.offload


def test_write_fsdp_reports_optimizer_only_offload() -> None:
    spec = read_deepspeed(Located({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                                  "ds.json")).value
    t = write_accelerate_fsdp(spec)
    assert t.value["fsdp_config"]["fsdp_offload_params"] is True
    assert status(t, "offload") is Status.APPROXIMATED and status(t, "sharding") is Status.APPROXIMATED


# ---------------------------------------------------------------------------------------------- round trip

@st.composite
def fsdp2_yaml(draw: st.DrawFn) -> dict[str, Any]:
    replicate, shard = draw(st.sampled_from([(1, 1), (1, 4), (2, 2), (2, 4), (4, 2)]))
    config: dict[str, Any] = {"fsdp_version": 2}
    for key, choices in (("fsdp_reshard_after_forward", [True, False, "true", "false"]),
                         ("fsdp_offload_params", [True, False]),
                         ("fsdp_auto_wrap_policy", ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]),
                         ("fsdp_transformer_layer_cls_to_wrap", ["LlamaDecoderLayer", "A,B"]),
                         ("fsdp_min_num_params", [0, 1000, 10**8]),
                         ("fsdp_state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"]),
                         ("fsdp_activation_checkpointing", [True, False]),
                         ("fsdp_cpu_ram_efficient_loading", [False]), ("fsdp_use_orig_params", [True, False])):
        if draw(st.booleans()):
            config[key] = draw(st.sampled_from(choices))
    data: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": config,
                            "compute_environment": "LOCAL_MACHINE", "machine_rank": 0}
    if draw(st.booleans()):
        data["mixed_precision"] = draw(st.sampled_from(["no", "fp16", "bf16"]))
    if replicate * shard > 1:
        data["num_processes"] = replicate * shard
        if replicate > 1 or draw(st.booleans()):
            data["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate,
                                          "parallelism_config_dp_shard_size": shard}
    elif draw(st.booleans()):
        data["num_processes"] = draw(st.sampled_from([2, 8]))
    if draw(st.booleans()):
        data["dynamo_config"] = draw(st.fixed_dictionaries(
            {"dynamo_backend": st.sampled_from(["NO", "INDUCTOR", "aot_eager", "EAGER"]),
             "dynamo_use_dynamic": st.booleans()},
            optional={"dynamo_mode": st.sampled_from(["default", "reduce-overhead", "max-autotune",
                                                      "max-autotune-no-cudagraphs"]),
                      "dynamo_use_fullgraph": st.booleans(), "dynamo_use_regional_compilation": st.booleans()}))
    return data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fsdp2_yaml())
def test_fsdp2_yaml_round_trips(data: dict[str, Any]) -> None:
    spec = read_accelerate(Located(data, "gen.yaml")).value
    written = write_accelerate_fsdp(spec)
    assert written.report.exact, written.report.render()
    again = read_accelerate(Located(yaml.safe_load(yaml.safe_dump(written.value)), "back.yaml")).value
    assert again == spec


# ---------------------------------------------------------------------------------------------- Accelerate itself

@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Run Accelerate's own launcher on a config dict: the env its plugins read."""
    pytest.importorskip("accelerate")
    launch_mod = pytest.importorskip("accelerate.commands.launch")
    utils_launch = pytest.importorskip("accelerate.utils.launch")

    def run(config: dict[str, Any]) -> dict[str, str]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        args = launch_mod.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, defaults, mp_from_config = launch_mod._validate_launch_command(args)
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            env = utils_launch.prepare_deepspeed_cmd_env(args)[1]
        else:
            env = utils_launch.prepare_multi_gpu_env(args)
        for key, value in env.items():
            if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
                monkeypatch.setenv(key, value)
        return env

    yield run


@needs_corpus
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", ["hiyouga__LLaMA-Factory__examples__accelerate__fsdp_config_multiple_nodes.yaml",
                                  "hiyouga__LLaMA-Factory__examples__accelerate__fsdp_config_offload.yaml",
                                  "huggingface__accelerate__tests__test_configs__latest_fsdp.yaml"])
def test_accelerate_fsdp_plugin_reads_what_we_write(launch: Any, tmp_path: Path, name: str, version: int) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy, StateDictType
    spec = read_corpus(name, tmp_path).value
    out = write_accelerate_fsdp(spec, fsdp_version=version).value
    # sync_module_states makes the plugin ask for an accelerator device, which this machine lacks
    out["fsdp_config"].update(fsdp_sync_module_states=False, fsdp_cpu_ram_efficient_loading=False)
    launch(out)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == version
    if version == 1:
        assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD
        assert (plugin.backward_prefetch is None) == (spec.communication.backward_prefetch.value == "none")
        assert plugin.cpu_offload.offload_params == spec.offload.parameters.enabled
    else:
        assert plugin.reshard_after_forward is True
        assert type(plugin.cpu_offload).__name__ == ("CPUOffloadPolicy" if spec.offload.parameters.enabled
                                                     else "OffloadPolicy")
    full = spec.checkpoint.format == CheckpointFormat.FULL
    assert plugin.state_dict_type == (StateDictType.FULL_STATE_DICT if full else StateDictType.SHARDED_STATE_DICT)


def test_accelerate_fsdp2_plugin_shard_grad_op(launch: Any) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    launch(write_accelerate_fsdp(read(FSDP_V2).value).value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.reshard_after_forward is False and plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


@pytest.mark.parametrize("text", [
    "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 8\ndeepspeed_config:\n"
    "  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: cpu\n  zero3_save_16bit_model: true\n",
    "distributed_type: DEEPSPEED\nmixed_precision: fp16\nnum_processes: 2\ndeepspeed_config:\n"
    "  zero_stage: 1\n  gradient_accumulation_steps: 4\n  gradient_clipping: 0.5\n",
])
def test_deepspeed_plugin_builds_the_json_we_read(launch: Any, text: str) -> None:
    from accelerate.utils import DeepSpeedPlugin
    ours = read(text).value
    written = write_accelerate_deepspeed(ours).value
    launch(written)
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision(written["mixed_precision"])
    config = {k: v for k, v in plugin.deepspeed_config.items() if k != "steps_per_print"}
    theirs = read_deepspeed(Located(config, "accelerate-built.json")).value
    drop = {"passthrough": True, "sharding": {"world_size"}}
    assert theirs.model_dump(exclude=drop) == ours.model_dump(exclude=drop)
