"""spec -> torchtitan TOML: what is written is valid for torchtitan's TOML job config, reads back to the same run,
keeps every key of a torchtitan source, reports each approximation and refuses what has no form.

torchtitan 0.3.0 (PyPI) no longer loads a TOML: its ConfigManager takes ``--module``/``--config`` (a Python
config registry), so it cannot check these files. torchtitan 0.2.0, the last release that reads
``--job.config_file``, imports its models (triton) with its config package, so it is not a test dependency
either. ``SCHEMA`` is derived from the ``JobConfig`` dataclasses of those TOML releases
(``torchtitan/config/job_config.py``: 0.2.0's ``[quantize.linear.float8]`` and the older ``[float8]`` the corpus
uses): for every key the writer fills, the type or the values torchtitan's parser accepts. Where a torchtitan
that still has ``JobConfig`` is importable, ``test_torchtitan_loads_it`` loads the files with its own
ConfigManager.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import tomllib
from conftest import corpus_files

from zerobridge.cli import main
from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.registry import strategies
from zerobridge.translate.formats import render, write
from zerobridge.translate.report import Status
from zerobridge.translate.run_level import with_run_settings

DEGREE = int
SCHEMA: dict[str, dict[str, Any]] = {
    "parallelism": {"data_parallel_replicate_degree": DEGREE, "data_parallel_shard_degree": DEGREE,
                    "fsdp_reshard_after_forward": ("default", "always", "never")},
    "training": {"mixed_precision_param": ("bfloat16", "float32"), "mixed_precision_reduce": ("float32",),
                 "enable_cpu_offload": bool, "max_norm": float, "local_batch_size": int, "global_batch_size": int},
    "activation_checkpoint": {"mode": ("selective", "full", "none")},
    "compile": {"enable": bool, "components": [("model", "loss")], "backend": str},
    "float8": {"enable_fsdp_float8_all_gather": bool, "precompute_float8_dynamic_scale_for_fsdp": bool},
    "quantize.linear.float8": {"enable_fsdp_float8_all_gather": bool, "precompute_float8_dynamic_scale_for_fsdp": bool},
    "model": {"converters": [str]},
}
"""Section -> key -> what torchtitan's TOML JobConfig accepts: a type, a tuple of literal values, or [item]."""

ALIASES = {"training.batch_size": "training.local_batch_size", "training.compile": "compile.enable"}
"""Older torchtitan names the reader accepts and the writer writes in their current form."""


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def conforms(value: Any, rule: Any) -> bool:
    if isinstance(rule, tuple):
        return value in rule
    if isinstance(rule, list):
        return isinstance(value, list) and all(conforms(v, rule[0]) for v in value) or (
            isinstance(value, str) and rule[0] is str)  # older configs: a comma-separated string
    if rule is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, rule) and not (rule is int and isinstance(value, bool))


def written_toml(spec: Any) -> tuple[dict[str, Any], Any]:
    """The TOML text written for ``spec``, parsed back with tomllib; and the report."""
    t = write(spec, "torchtitan")
    return tomllib.loads(render(t.value, "torchtitan")), t.report


def check_schema(data: dict[str, Any], carried: dict[str, Any]) -> None:
    """Every key the writer filled (not carried from a torchtitan source) is one torchtitan reads, well typed."""
    for path, value in flat(data).items():
        if path in flat(carried):
            continue
        section, key = path.rsplit(".", 1)
        assert section in SCHEMA and key in SCHEMA[section], f"torchtitan has no key {path}"
        assert conforms(value, SCHEMA[section][key]), f"{path} = {value!r}"


@pytest.mark.parametrize("name", [s.name for s in strategies()])
def test_registry_entry_writes_a_valid_toml_or_refuses(name: str) -> None:
    spec = with_run_settings(load_spec(name).value, world_size=8, micro_batch=2).value
    try:
        data, report = written_toml(spec)
    except ConfigError as exc:
        assert "torchtitan has no form for it" in exc.message and exc.fix
        assert exc.key in ("offload", "sharding.shard_group") and ("nvme" in exc.message or "'node'" in exc.message)
        return
    check_schema(data, {})
    back = load_spec_from(data, tmp_name=name).value
    assert back.sharding.parameters == spec.sharding.parameters or spec.sharding.stage in (1, 2)
    assert back.sharding.stage.value == (0 if spec.sharding.stage == 0 else 3)
    assert back.offload.parameters.enabled == (spec.offload.parameters.enabled or spec.offload.optimizer.enabled)
    assert back.batch.micro_batch_size == 2
    if spec.sharding.stage in (1, 2):
        assert report.find("sharding").status is Status.APPROXIMATED
    assert len(report.warnings) <= 3


def load_spec_from(data: dict[str, Any], tmp_name: str) -> Any:
    from zerobridge.translate.sources import parse_toml
    from zerobridge.translate.torchtitan import read_torchtitan

    return read_torchtitan(parse_toml(render(data, "torchtitan"), f"{tmp_name}.toml"), world_size=8)


@pytest.mark.corpus
@pytest.mark.parametrize("path", corpus_files("torchtitan"), ids=lambda p: p.name)
def test_corpus_toml_round_trip_keeps_every_key(path: Path) -> None:
    source = flat(tomllib.loads(path.read_text(encoding="utf-8")))
    read = load_spec(path)
    data, report = written_toml(read.value)
    out = flat(data)
    kept = [key for key in source if ALIASES.get(key, key) in out]
    assert kept == list(source), f"lost {sorted(set(source) - set(kept))}"  # 100% of the keys
    approximated = {e.key for e in read.report.approximations}
    for key, value in source.items():
        new = out[ALIASES.get(key, key)]
        if key in approximated or key == "model.converters":
            continue  # read as the nearest spec form, reported; written as that form
        assert new == value or [new] == [value], f"{key}: {value!r} -> {new!r}"
    check_schema(data, read.value.passthrough.get("torchtitan", {}))
    assert len(report.warnings) <= 3


def test_refusals_name_what_has_no_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fp16 = with_run_settings(load_spec("zero3").value, precision="fp16").value
    with pytest.raises(ConfigError, match="compute dtype fp16: torchtitan has no form") as exc:
        write(fp16, "torchtitan")
    assert exc.value.key == "precision.param_dtype" and "bf16" in (exc.value.fix or "")
    with pytest.raises(ConfigError, match="stage 0"):
        write(load_spec("zero0").value, "torchtitan")  # DDP needs its replica count stated
    assert main(["convert", "zero-infinity", "--to", "torchtitan"]) == 2
    assert "nvme" in capsys.readouterr().err


def test_approximations_are_reported() -> None:
    _, report = written_toml(load_spec("zero3-offload-optimizer").value)
    assert report.find("offload").status is Status.APPROXIMATED
    spec = load_spec("zero3").value.model_copy(update={"batch": load_spec("zero3").value.batch.model_copy(
        update={"clip_grad_norm": None})})
    data, report = written_toml(spec)
    assert math.isinf(data["training"]["max_norm"]) and report.find("batch.clip_grad_norm").status.value == "equivalent"


def test_cli_prints_toml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "zero3", "--to", "torchtitan", "--world-size", "8", "--micro-batch", "2"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["parallelism"]["data_parallel_shard_degree"] == -1 and data["training"]["local_batch_size"] == 2


def test_plan_writes_its_recommendation_as_torchtitan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``zerobridge plan --to torchtitan``: the recommendation as a TOML torchtitan reads (one own candidate, so
    the plan measures one layout in this process)."""
    out = tmp_path / "plan.toml"
    code = main(["plan", "tiny-gpt", "--world-size", "2", "--device-memory", "8GiB", "--seq-len", "32",
                 "--config", "zero3", "--only-own", "--to", "torchtitan", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    data = tomllib.loads(out.read_text(encoding="utf-8"))
    check_schema(data, {})
    assert data["parallelism"]["data_parallel_shard_degree"] in (-1, 2), data["parallelism"]


def test_torchtitan_loads_it(tmp_path: Path) -> None:
    """torchtitan's own ConfigManager, where an installed torchtitan still reads TOML (JobConfig)."""
    job_config = pytest.importorskip("torchtitan.config.job_config", reason="no torchtitan with TOML configs")
    from torchtitan.config.manager import ConfigManager

    for name in ("zero3", "zero3-offload", "fsdp2-no-reshard"):
        path = tmp_path / f"{name}.toml"
        data, _ = written_toml(with_run_settings(load_spec(name).value, world_size=8).value)
        path.write_text(render(data, "torchtitan"), encoding="utf-8")
        config = ConfigManager().parse_args([f"--job.config_file={path}"])
        assert isinstance(config, job_config.JobConfig)
        assert config.parallelism.fsdp_reshard_after_forward == data["parallelism"]["fsdp_reshard_after_forward"]
