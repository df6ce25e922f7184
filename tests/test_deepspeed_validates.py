"""Every DeepSpeed JSON zerobridge writes passes DeepSpeed's own config
validation (``deepspeed.runtime.config.DeepSpeedConfig``), for the registry
and for every corpus config round-tripped through the spec."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import corpus_files
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zerobridge.registry import strategies
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.sources import parse_json, read_text

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed_config = pytest.importorskip("deepspeed.runtime.config")

# What HF Trainer / Accelerate put in place of "auto" before DeepSpeed sees it.
_FILLED = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0}


def _fill_top_level_auto(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: (_FILLED[k] if v == "auto" and k in _FILLED else v) for k, v in config.items()}
    if "train_batch_size" not in out and "train_micro_batch_size_per_gpu" not in out:
        out["train_micro_batch_size_per_gpu"] = 8
    if out.get("train_batch_size") == 8 and out.get("train_micro_batch_size_per_gpu") not in (None, 8):
        out.pop("train_batch_size")
    for section in ("optimizer", "scheduler"):
        out.pop(section, None)  # "auto" hyper-parameters are the trainer's to fill
    return out


def deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def _validate(config: dict[str, Any]) -> Any:
    return deepspeed_config.DeepSpeedConfig(_fill_top_level_auto(config))


@pytest.mark.parametrize("entry", [s for s in strategies() if s.source_format == "deepspeed"],
                         ids=lambda s: s.name)
def test_registry_output_validates(entry: Any) -> None:
    spec = entry.spec().value
    ds = _validate(write_deepspeed(spec).value)
    assert ds.zero_optimization_stage == min(spec.sharding.stage.value, 3)


@pytest.mark.parametrize("entry", [s for s in strategies() if s.source_format != "deepspeed"],
                         ids=lambda s: s.name)
def test_fsdp_registry_output_validates(entry: Any) -> None:
    _validate(write_deepspeed(entry.spec().value).value)


@pytest.mark.corpus
@pytest.mark.parametrize("path", corpus_files("deepspeed"), ids=lambda p: p.name)
def test_corpus_round_trip_validates(path: Path) -> None:
    source = parse_json(read_text(path), str(path))
    spec = read_deepspeed(source).value
    config = write_deepspeed(spec).value
    try:
        ds = _validate(config)
    except Exception as ours:
        # Allowed only where DeepSpeed rejects the source itself, in a section
        # zerobridge carries verbatim (axolotl's compile keys; an old
        # reduce_bucket_size 0): never a failure zerobridge introduced.
        with pytest.raises(type(ours)):
            _validate(source.data)
        pytest.skip(f"DeepSpeed {deepspeed_version()} rejects the source itself: {str(ours).splitlines()[0]}")
    assert ds.zero_optimization_stage == spec.sharding.stage.value
    expected_clip = spec.batch.clip_grad_norm
    if isinstance(expected_clip, float):
        assert ds.gradient_clipping == expected_clip


# --- keys DeepSpeed removed, and generated sources ---------------------------------------------------------


def _accepts(config: dict[str, Any]) -> bool:
    try:
        _validate(config)
    except Exception:
        return False
    return True


def test_removed_keys_are_reported_and_never_written() -> None:
    """DeepSpeed 0.19.8 raises on MiCS's leftover flag: the output must not carry it."""
    source = {"train_micro_batch_size_per_gpu": 1, "sparse_gradients": False,
              "zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": False}}
    assert not _accepts(source)
    translation = read_deepspeed(parse_json(json.dumps(source), "mics.json"))
    config = write_deepspeed(translation.value).value
    assert "mics_hierarchical_params_gather" not in config["zero_optimization"] and "sparse_gradients" not in config
    _validate(config)
    entry = translation.report.find("zero_optimization.mics_hierarchical_params_gather")
    assert entry is not None and entry.status.value == "not_expressible" and "raises on it" in entry.note


def test_every_removed_key_in_the_table_is_one_deepspeed_raises_on() -> None:
    from zerobridge.translate.mapping import load_table

    removed = load_table("deepspeed").removed
    assert "zero_optimization.mics_hierarchical_params_gather" in removed
    for path in removed:
        *parents, leaf = path.split(".")
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = {}
        assert not _accepts(config), f"DeepSpeed {deepspeed_version()} accepts {path}: drop it from [removed]"


_AUTO_OR = lambda values: st.one_of(st.just("auto"), values)
_OFFLOAD = st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu", "nvme"])},
                                 optional={"pin_memory": st.booleans(), "nvme_path": st.just("/local_nvme")})
_ZERO = st.fixed_dictionaries(
    {"stage": st.integers(0, 3)},
    optional={
        "offload_optimizer": _OFFLOAD, "offload_param": _OFFLOAD, "overlap_comm": st.booleans(),
        "contiguous_gradients": st.booleans(), "reduce_scatter": st.booleans(),
        "reduce_bucket_size": _AUTO_OR(st.sampled_from([0, 2e8, 5e8])),
        "allgather_bucket_size": st.sampled_from([2e8, 5e8]),
        "stage3_prefetch_bucket_size": _AUTO_OR(st.sampled_from([0, 5e7])),
        "stage3_param_persistence_threshold": _AUTO_OR(st.sampled_from([0, 1e5])),
        "stage3_max_live_parameters": st.sampled_from([1e9, 3e8]),
        "stage3_max_reuse_distance": st.sampled_from([0, 1e9]),
        "stage3_gather_16bit_weights_on_model_save": _AUTO_OR(st.booleans()),
        "sub_group_size": st.sampled_from([1e9, 1e8]),
        "zero_hpz_partition_size": st.sampled_from([1, 2, 8]), "mics_shard_size": st.sampled_from([-1, 2, 8]),
        "mics_hierarchical_params_gather": st.booleans(), "zeropp_loco_param": st.just({"err_beta": 0.8}),
        "round_robin_gradients": st.booleans(), "zero_quantized_gradients": st.booleans(),
        "load_from_fp32_weights": st.booleans(),
    })
_SOURCES = st.fixed_dictionaries(
    {"zero_optimization": _ZERO},
    optional={
        "fp16": st.fixed_dictionaries({"enabled": _AUTO_OR(st.booleans())},
                                      optional={"loss_scale": st.sampled_from([0, 128]),
                                                "initial_scale_power": st.integers(8, 16),
                                                "loss_scale_window": st.sampled_from([500, 1000]),
                                                "hysteresis": st.integers(1, 2), "min_loss_scale": st.just(1)}),
        "bf16": st.fixed_dictionaries({"enabled": _AUTO_OR(st.booleans())}),
        "gradient_clipping": _AUTO_OR(st.sampled_from([0.0, 1.0, 0.5])),
        "train_micro_batch_size_per_gpu": _AUTO_OR(st.sampled_from([1, 4])),
        "gradient_accumulation_steps": _AUTO_OR(st.sampled_from([1, 2])),
        "communication_data_type": st.sampled_from(["fp32", "bf16", "fp16"]),
        "steps_per_print": st.just(10), "wall_clock_breakdown": st.booleans(),
        "optimizer": st.just({"type": "AdamW", "params": {"lr": "auto"}}),
        "sparse_gradients": st.booleans(), "amp": st.just({"enabled": False}),
        "curriculum_learning": st.just({"enabled": False}),
        "compile": st.fixed_dictionaries({}, optional={  # DeepCompile keys, and the legacy ones 0.19.8 rejects
            "deepcompile": st.booleans(), "passes": st.just(["z1"]), "disable": st.booleans(),
            "backend": st.just("inductor"), "kwargs": st.just({"mode": "max-autotune"})}),
    })
_LEGACY_COMPILE = ("enabled", "disable", "backend", "kwargs", "mode", "fullgraph", "dynamic", "options")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=_SOURCES)
def test_generated_sources_validate_after_the_round_trip(source: dict[str, Any]) -> None:
    """Whenever DeepSpeed accepts a source (the keys it removed aside, which the output
    drops), it accepts what zerobridge writes for it."""
    from zerobridge.errors import ConfigError
    from zerobridge.translate.mapping import load_table

    removed = load_table("deepspeed").removed
    kept = {k: v for k, v in source.items() if k not in removed}
    kept["zero_optimization"] = {k: v for k, v in source["zero_optimization"].items()
                                 if f"zero_optimization.{k}" not in removed}
    if "compile" in source:  # read into the spec's compile, never written
        kept["compile"] = {k: v for k, v in source["compile"].items() if k not in _LEGACY_COMPILE}
    assume(_accepts(kept))
    try:
        spec = read_deepspeed(parse_json(json.dumps(source), "generated.json")).value
    except ConfigError:
        return  # refused with a message (a combination DeepSpeed would silently ignore)
    config = write_deepspeed(spec).value
    _validate(config)
    if "disable" in source.get("compile", {}):
        assert spec.compile.enabled is not source["compile"]["disable"]
