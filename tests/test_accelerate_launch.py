"""Every Accelerate config zerobridge writes gets through ``accelerate launch``: its own
validation (``_validate_launch_command``), the environment its launcher prepares
(``prepare_multi_gpu_env`` for FSDP, ``prepare_deepspeed_cmd_env`` for DeepSpeed) and
the plugin the training process builds from that environment, for both flavors, every
registry entry and every corpus file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import corpus_files

from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.registry import strategies
from zerobridge.spec import StrategySpec
from zerobridge.spec.compilation import CompileMode, CompileScope, CompileSpec
from zerobridge.translate.accelerate_write import write_accelerate_deepspeed, write_accelerate_fsdp
from zerobridge.translate.run_level import with_run_settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
launch = pytest.importorskip("accelerate.commands.launch")
launch_utils = pytest.importorskip("accelerate.utils.launch")

WORLD = 16
"""World size for sources that fix none (every registry group divides it)."""
WRITERS = {"accelerate-fsdp": write_accelerate_fsdp, "accelerate-deepspeed": write_accelerate_deepspeed}


def launched(config: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What ``accelerate launch --config_file`` makes of ``config``: the plugin its training
    process builds (None for plain data parallelism, which needs none)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, mixed_from_config = launch._validate_launch_command(args)
    if args.use_deepspeed:  # as launch_command does before deepspeed_launcher
        fields = [*defaults.deepspeed_config.keys(), *(["mixed_precision"] if mixed_from_config else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = launch_utils.prepare_deepspeed_cmd_env(args)
    else:
        assert args.use_fsdp or args.multi_gpu, f"launched as {config.get('distributed_type')}"
        env = launch_utils.prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if args.use_deepspeed:
        return DeepSpeedPlugin()
    return FullyShardedDataParallelPlugin() if args.use_fsdp else None


def check(spec: StrategySpec, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if spec.sharding.world_size is None:
        spec = with_run_settings(spec, world_size=WORLD).value
    config = WRITERS[target](spec).value
    assert config["num_processes"] == spec.sharding.world_size
    if config.get("mixed_precision") == "fp8":  # float8 all-gather (torchtitan's 405B): an fp8 backend must exist
        from accelerate.utils import is_fp8_available

        if not is_fp8_available():
            with pytest.raises(RuntimeError, match="FP8 is not available"):
                launched(config, tmp_path, monkeypatch)
            config = {**config, "mixed_precision": "bf16"}  # the rest of the config, checked as launched
            config.pop("fp8_config")
    plugin = launched(config, tmp_path, monkeypatch)
    if plugin is None:  # nothing sharded: plain DDP, as zerobridge writes stage 0 for FSDP
        assert config["distributed_type"] == "MULTI_GPU" and spec.sharding.stage.value == 0
    elif target == "accelerate-deepspeed":
        assert plugin.zero_stage == config["deepspeed_config"].get("zero_stage", plugin.zero_stage)
    else:
        assert plugin.fsdp_version == config["fsdp_config"].get("fsdp_version", 1)


@pytest.mark.parametrize("target", list(WRITERS))
@pytest.mark.parametrize("entry", strategies(), ids=lambda s: s.name)
def test_registry_entries_launch(entry: Any, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check(entry.spec().value, target, tmp_path, monkeypatch)


@pytest.mark.corpus
@pytest.mark.parametrize("target", list(WRITERS))
@pytest.mark.parametrize("path", corpus_files("deepspeed") + corpus_files("accelerate") + corpus_files("torchtitan"),
                         ids=lambda p: p.name)
def test_corpus_files_launch(path: Path, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        spec = load_spec(path).value
    except ConfigError as exc:  # e.g. a template naming a DeepSpeed file the corpus does not hold
        pytest.skip(f"the source itself does not load: {exc.message}")
    check(spec, target, tmp_path, monkeypatch)


def test_without_a_world_size_accelerate_refuses_and_the_report_says_which_flag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    translation = write_accelerate_fsdp(load_spec("zero3").value)
    entry = translation.report.find("sharding.world_size")
    assert entry is not None and "--world-size N" in entry.note and "--num_processes N" in entry.note
    with pytest.raises(ValueError, match="num_processes"):
        launched(translation.value, tmp_path, monkeypatch)


@pytest.mark.parametrize("scope", list(CompileScope))
def test_compiled_spec_launches_with_its_dynamo_plugin(scope: CompileScope, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo_config passes the launcher's checks and reaches TorchDynamoPlugin as the spec says."""
    from accelerate.utils import TorchDynamoPlugin

    compile = CompileSpec(enabled=True, backend="aot_eager", mode=CompileMode.MAX_AUTOTUNE_NO_CUDAGRAPHS, scope=scope,
                          fullgraph=True, dynamic=True)
    check(load_spec("zero3").value.model_copy(update={"compile": compile}), "accelerate-fsdp", tmp_path, monkeypatch)
    plugin = TorchDynamoPlugin()
    assert plugin.backend.value == "AOT_EAGER" and plugin.mode == compile.mode.value
    assert plugin.fullgraph is True and plugin.dynamic is True
    assert plugin.use_regional_compilation is (scope is CompileScope.UNITS)
    assert plugin.to_kwargs()["backend"] == "aot_eager"  # what torch.compile gets


def test_deepspeed_runs_get_no_dynamo_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the DeepSpeed flavor reports compile as not expressible: a dynamo_config beside
    distributed_type DEEPSPEED never reaches the training process."""
    from accelerate.utils import TorchDynamoPlugin

    spec = with_run_settings(load_spec("zero2").value, world_size=WORLD).value
    config = {**write_accelerate_deepspeed(spec).value, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    launched(config, tmp_path, monkeypatch)
    assert TorchDynamoPlugin().backend.value == "NO"
