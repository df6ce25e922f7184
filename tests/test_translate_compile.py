"""The spec's ``compile`` in every format: DeepSpeed's legacy keys (read), Accelerate's
dynamo_config (both ways), torchtitan's [compile] (read), and the writers without a form
(FSDP1, FSDP2, Lightning, DeepSpeed 0.19.8). No process group."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import corpus_files

from zerobridge.cli import main
from zerobridge.errors import ConfigError
from zerobridge.spec import ShardingSpec, StrategySpec
from zerobridge.spec.compilation import CompileMode, CompileScope, CompileSpec
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.accelerate_write import write_accelerate_deepspeed, write_accelerate_fsdp
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.fsdp1 import write_fsdp1
from zerobridge.translate.fsdp2 import read_fsdp2, write_fsdp2
from zerobridge.translate.lightning import write_lightning
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located, parse_json, parse_toml, parse_yaml, read_text
from zerobridge.translate.torchtitan import read_torchtitan

os.environ.setdefault("DS_ACCELERATOR", "cpu")

BASE = StrategySpec(sharding=ShardingSpec.for_stage(3).model_copy(update={"world_size": 8}))
COMPILED = BASE.model_copy(update={"compile": CompileSpec(enabled=True, mode=CompileMode.MAX_AUTOTUNE,
                                                           fullgraph=True, dynamic=False)})
AXOLOTL = [p for p in corpus_files("deepspeed") if p.name.endswith("_torch_compile.json")]


def compiled(**fields: Any) -> StrategySpec:
    return BASE.model_copy(update={"compile": CompileSpec(**fields)})


def status(report: Report, key: str) -> Status:
    entry = report.find(key)
    assert entry is not None, f"{key} not in report:\n{report.render()}"
    return entry.status


def ds(compile_section: dict[str, Any]) -> Translation[StrategySpec]:
    return read_deepspeed(Located({"zero_optimization": {"stage": 2}, "compile": compile_section}, "ds.json"))


def accelerate(dynamo: dict[str, Any], **top: Any) -> Translation[StrategySpec]:
    data = {"distributed_type": "FSDP", "num_processes": 8, "fsdp_config": {"fsdp_version": 2}, **top}
    if dynamo:
        data["dynamo_config"] = dynamo
    return read_accelerate(Located(data, "accelerate.yaml"))


def titan(text: str) -> Translation[StrategySpec]:
    return read_torchtitan(parse_toml(text, "job.toml"))


# ---------------------------------------------------------------------------------------------- DeepSpeed

@pytest.mark.parametrize("section, expected", [
    ({"disable": False, "backend": "inductor"}, CompileSpec(enabled=True, scope=CompileScope.MODEL)),
    ({"disable": True}, CompileSpec()),
    ({"enabled": True, "backend": "aot_eager", "kwargs": {"mode": "max-autotune", "fullgraph": True, "dynamic": False}},
     CompileSpec(enabled=True, backend="aot_eager", mode=CompileMode.MAX_AUTOTUNE, scope=CompileScope.MODEL,
                 fullgraph=True, dynamic=False)),
    ({"enabled": True, "mode": "reduce-overhead", "dynamic": None},
     CompileSpec(enabled=True, mode=CompileMode.REDUCE_OVERHEAD, scope=CompileScope.MODEL)),
    ({"enabled": False, "backend": "eager"}, CompileSpec(backend="eager")),
])
def test_deepspeed_legacy_keys_read_exactly(section: dict[str, Any], expected: CompileSpec) -> None:
    t = ds(section)
    assert t.value.compile == expected
    for key in section:
        assert status(t.report, f"compile.{key}") is Status.EXACT
    assert "compile" not in t.value.passthrough.get("deepspeed", {})


@pytest.mark.parametrize("path", AXOLOTL, ids=lambda p: p.name)
def test_axolotl_compile_configs_convert_with_compile_exact(path: Path) -> None:
    t = read_deepspeed(parse_json(read_text(path), str(path)))
    assert t.value.compile == CompileSpec(enabled=True, backend="inductor", scope=CompileScope.MODEL)
    assert status(t.report, "compile.disable") is Status.EXACT and status(t.report, "compile.backend") is Status.EXACT
    written = write_deepspeed(t.value)
    assert "compile" not in written.value
    entry = written.report.find("compile")
    assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE
    assert "engine.compile(backend='inductor'" in entry.note and "dynamo_config" in entry.note


def test_the_corpus_compile_configs_are_there_when_the_corpus_is() -> None:
    if not corpus_files("deepspeed"):
        pytest.skip("no corpus")
    assert len(AXOLOTL) == 2


@pytest.mark.parametrize("spec", [COMPILED, compiled(enabled=True), compiled(enabled=True, scope=CompileScope.MODEL)])
def test_deepspeed_write_validates_and_names_the_call(spec: StrategySpec) -> None:
    config = pytest.importorskip("deepspeed.runtime.config")
    written = write_deepspeed(spec)
    config.DeepSpeedConfig({**written.value, "train_micro_batch_size_per_gpu": 1})
    entry = written.report.find("compile")
    assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE
    assert f"engine.compile(backend={spec.compile.backend!r}" in entry.note
    assert ("module.compile(" in entry.note) == (spec.compile.scope is CompileScope.UNITS)


def test_deepcompile_keys_stay_carried_and_validate() -> None:
    config = pytest.importorskip("deepspeed.runtime.config")
    t = ds({"deepcompile": True, "passes": ["z1"]})
    assert t.value.compile == CompileSpec() and status(t.report, "compile.deepcompile") is Status.NOT_ABOUT_SHARDING
    written = write_deepspeed(t.value).value
    assert written["compile"] == {"deepcompile": True, "passes": ["z1"]}
    config.DeepSpeedConfig({**written, "train_micro_batch_size_per_gpu": 1})


def test_inductor_options_are_reported_and_dropped() -> None:
    t = ds({"enabled": True, "kwargs": {"options": {"max_autotune": True}}})
    assert status(t.report, "compile.kwargs.options") is Status.NOT_EXPRESSIBLE
    assert "compile" not in write_deepspeed(t.value).value


@pytest.mark.parametrize("section, key, fragment, fix", [
    ({"disable": "no"}, "compile.disable", "expected true or false", "write true or false"),
    ({"enabled": True, "disable": False}, "compile.disable", "both given", "keep one"),
    ({"kwargs": {"fullgrap": True}}, "compile.kwargs.fullgrap", "unknown key", "did you mean 'fullgraph'"),
    ({"dynamic": "maybe"}, "compile.dynamic", "expected true, false or null", "write true, false or null"),
    ({"mode": "fastest"}, "compile.mode", "expected one of default", None),
    ({"mode": "default", "kwargs": {"mode": "max-autotune"}}, "compile.kwargs.mode", "given twice", "keep only"),
])
def test_deepspeed_bad_compile_values(section: dict[str, Any], key: str, fragment: str, fix: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        ds(section)
    assert err.value.key == key and fragment in err.value.message and "ds.json" in str(err.value)
    assert fix is None or fix in (err.value.fix or "")


# ---------------------------------------------------------------------------------------------- Accelerate

def test_accelerate_dynamo_config_reads_exactly() -> None:
    t = accelerate({"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune", "dynamo_use_fullgraph": True,
                    "dynamo_use_dynamic": True, "dynamo_use_regional_compilation": True})
    assert t.value.compile == CompileSpec(enabled=True, mode=CompileMode.MAX_AUTOTUNE, fullgraph=True, dynamic=True)
    for key in ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic"):
        assert status(t.report, f"dynamo_config.{key}") is Status.EXACT
    assert status(t.report, "dynamo_config.dynamo_use_regional_compilation") is Status.EQUIVALENT


@pytest.mark.parametrize("dynamo, top, expected", [
    ({"backend": "aot_eager", "use_fullgraph": "true"}, {},  # unprefixed keys, as the launcher reads them
     CompileSpec(enabled=True, backend="aot_eager", scope=CompileScope.MODEL, fullgraph=True, dynamic=False)),
    ({}, {"dynamo_backend": "INDUCTOR"}, CompileSpec(enabled=True, scope=CompileScope.MODEL, dynamic=False)),
    ({}, {"dynamo_backend": "NO"}, CompileSpec()),
    ({"dynamo_backend": "NO", "dynamo_mode": "max-autotune"}, {}, CompileSpec()),
    ({}, {}, CompileSpec()),
])
def test_accelerate_launcher_forms(dynamo: dict[str, Any], top: dict[str, Any], expected: CompileSpec) -> None:
    assert accelerate(dynamo, **top).value.compile == expected


def test_accelerate_corpus_dynamo_backend_no_is_off() -> None:
    paths = [p for p in corpus_files("accelerate") if "dynamo_backend" in p.read_text()]
    if not paths:
        pytest.skip("no corpus")
    for path in paths:
        t = read_accelerate(parse_yaml(path.read_text(), str(path)))
        assert t.value.compile == CompileSpec() and status(t.report, "dynamo_backend") is Status.EXACT


@pytest.mark.parametrize("dynamo, top, key, fragment, fix", [
    ({"dynamo_backend": "INDUCTR"}, {}, "dynamo_config.dynamo_backend", "expected one of NO", "'INDUCTOR'"),
    ({"dynamo_use_fulgraph": True}, {}, "dynamo_config.dynamo_use_fulgraph", "unknown key",
     "'dynamo_use_fullgraph'"),
    ({"dynamo_use_dynamic": "sometimes"}, {}, "dynamo_config.dynamo_use_dynamic", "expected true or false",
     "write true or false"),
    ({"dynamo_mode": "default"}, {"dynamo_backend": "INDUCTOR"}, "dynamo_backend", "beside dynamo_config",
     "into dynamo_config"),
])
def test_accelerate_bad_dynamo(dynamo: dict[str, Any], top: dict[str, Any], key: str, fragment: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        accelerate(dynamo, **top)
    assert err.value.key == key and fragment in err.value.message and fix in (err.value.fix or "")


@pytest.mark.parametrize("scope", list(CompileScope))
@pytest.mark.parametrize("mode", list(CompileMode))
@pytest.mark.parametrize("fullgraph, dynamic", [(False, False), (True, True)])
def test_accelerate_round_trip(scope: CompileScope, mode: CompileMode, fullgraph: bool, dynamic: bool) -> None:
    spec = compiled(enabled=True, backend="aot_eager", scope=scope, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    written = write_accelerate_fsdp(spec)
    back = read_accelerate(Located(yaml.safe_load(yaml.safe_dump(written.value)), "back.yaml")).value
    assert back.compile == spec.compile
    assert status(written.report, "compile") is Status.EXACT
    assert (written.report.find("compile.scope") is not None) == (scope is CompileScope.UNITS)


def test_accelerate_compile_off_writes_nothing() -> None:
    assert "dynamo_config" not in write_accelerate_fsdp(BASE).value
    off = write_accelerate_fsdp(compiled(backend="eager", mode=CompileMode.MAX_AUTOTUNE))
    assert "dynamo_config" not in off.value and status(off.report, "compile") is Status.EQUIVALENT
    back = read_accelerate(Located(off.value, "back.yaml")).value
    assert back.compile == CompileSpec()


def test_accelerate_deepspeed_runs_are_not_compiled_by_the_launcher() -> None:
    """accelerate launch exports no dynamo setting for DeepSpeed (tests/test_accelerate_launch.py shows it)."""
    t = read_accelerate(Located({"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {
        "zero_stage": 2}, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "acc.yaml"))
    assert t.value.compile == CompileSpec() and status(t.report, "dynamo_config.dynamo_backend") is Status.IGNORED
    written = write_accelerate_deepspeed(COMPILED)
    assert "dynamo_config" not in written.value
    entry = written.report.find("compile")
    assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE and "TorchDynamoPlugin" in entry.note


def test_accelerate_dynamic_none_is_approximated_as_false() -> None:
    written = write_accelerate_fsdp(compiled(enabled=True))
    assert written.value["dynamo_config"]["dynamo_use_dynamic"] is False
    assert status(written.report, "compile.dynamic") is Status.APPROXIMATED


def test_accelerate_has_no_form_for_other_backends() -> None:
    written = write_accelerate_fsdp(compiled(enabled=True, backend="my_backend", dynamic=False))
    assert "dynamo_config" not in written.value
    assert status(written.report, "compile") is Status.NOT_EXPRESSIBLE


# ---------------------------------------------------------------------------------------------- torchtitan

FSDP_JOB = "[parallelism]\ndata_parallel_shard_degree = 8\n"


@pytest.mark.parametrize("section, expected", [
    ('[compile]\nenable = true\ncomponents = ["model"]\nbackend = "aot_eager"\n',
     CompileSpec(enabled=True, backend="aot_eager", fullgraph=True)),
    ("[training]\ncompile = true\n", CompileSpec(enabled=True, fullgraph=True)),
    ('[compile]\nenable = false\ncomponents = ["model", "loss"]\n', CompileSpec()),
    ("[training]\ncompile = false\n", CompileSpec()),
])
def test_torchtitan_compile_reads_exactly(section: str, expected: CompileSpec) -> None:
    t = titan(FSDP_JOB + section)
    assert t.value.compile == expected
    enable = "training.compile" if "training" in section else "compile.enable"
    assert status(t.report, enable) is Status.EXACT
    if "components" in section:
        assert status(t.report, "compile.components") is Status.EXACT


def test_torchtitan_loss_compile_is_not_expressible() -> None:
    t = titan(FSDP_JOB + "[compile]\nenable = true\n")  # components default: model and loss
    assert t.value.compile.enabled and status(t.report, "compile.components") is Status.NOT_EXPRESSIBLE
    only_loss = titan(FSDP_JOB + '[compile]\nenable = true\ncomponents = ["loss"]\n')
    assert not only_loss.value.compile.enabled
    assert status(only_loss.report, "compile.components") is Status.NOT_EXPRESSIBLE


def test_torchtitan_without_fsdp_compiles_one_unit() -> None:
    t = titan("[parallelism]\ndata_parallel_shard_degree = 1\n[training]\ncompile = true\n")
    assert t.value.compile.enabled and status(t.report, "training.compile") is Status.EQUIVALENT


@pytest.mark.parametrize("text, key, fragment", [
    ('[training]\ncompile = true\n[compile]\nenable = true\n', "compile.enable", "given twice"),
    ('[compile]\nenable = true\ncomponents = ["model", "optimizer"]\n', "compile.components", "'model' and 'loss'"),
    ('[compile]\nenable = "sometimes"\n', "compile.enable", "expected true or false"),
])
def test_torchtitan_bad_compile(text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        titan(FSDP_JOB + text)
    assert err.value.key == key and fragment in err.value.message and err.value.fix


@pytest.mark.parametrize("path", corpus_files("torchtitan"), ids=lambda p: p.stem.split("__")[-1])
def test_torchtitan_corpus_compile(path: Path) -> None:
    import tomllib

    data = tomllib.loads(path.read_text())
    on = data.get("training", {}).get("compile", data.get("compile", {}).get("enable", False))
    t = read_torchtitan(parse_toml(path.read_text(), str(path)))
    assert t.value.compile == (CompileSpec(enabled=True, fullgraph=True) if on else CompileSpec())


# ---------------------------------------------------------------------------------------------- no form

NO_FORM = {"fsdp1": write_fsdp1, "fsdp2": write_fsdp2, "lightning": write_lightning, "deepspeed": write_deepspeed}


@pytest.mark.parametrize("target", list(NO_FORM))
def test_formats_without_a_form_report_compile(target: str) -> None:
    write = NO_FORM[target]
    entry = write(COMPILED).report.find("compile")
    assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE and "torch.compile(" in entry.note
    assert write(BASE).report.find("compile") is None
    assert status(write(compiled(backend="eager")).report, "compile") is Status.EQUIVALENT  # off: changes nothing
    assert not [e for e in write(COMPILED).report.entries if e.key.startswith("compile.")]
    if target == "fsdp2":  # the readers are unaffected: the kwargs say nothing of compile
        assert read_fsdp2(Located(write(COMPILED).value, "fsdp2.json")).value.compile == CompileSpec()


# ---------------------------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("name, text, fragments", [
    ("ds.json", '{"zero_optimization": {"stage": 2}, "compile": {"disable": "no"}}',
     ["compile.disable", "expected true or false", "write true or false"]),
    ("acc.yaml", "distributed_type: FSDP\nnum_processes: 2\ndynamo_config:\n  dynamo_backend: INDUCTR\n",
     ["dynamo_config.dynamo_backend", "did you mean 'INDUCTOR'"]),
])
def test_bad_compile_values_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str,
                                   fragments: list[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    code = main(["convert", str(path), "--to", "fsdp2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_cli_converts_a_compiled_accelerate_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config: {fsdp_version: 2}\n"
                    "dynamo_config: {dynamo_backend: INDUCTOR, dynamo_use_regional_compilation: true}\n")
    assert main(["convert", str(path), "--to", "spec"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["compile"]["enabled"] is True and spec["compile"]["scope"] == "units"
