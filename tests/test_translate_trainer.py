"""The ``trainer`` format: launch scripts, flags files and TrainingArguments files read into the spec, and
``trainer-fsdp`` / ``trainer-deepspeed`` written and checked by their consumers: every written fsdp_config and
its flags parsed by ``HfArgumentParser(TrainingArguments)`` (its ``fsdp_plugin_args`` compared with what was
meant), every DeepSpeed JSON put through Trainer's own fill-and-check. No process group, no training."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import corpus_dir, corpus_files, in_original_layout

from zerobridge.cli import main
from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import write
from zerobridge.translate.launch_script import parse_flags_file, parse_launch_script
from zerobridge.translate.report import Status
from zerobridge.translate.trainer_flags import DEPRECATED_FLAGS, RENAMED_FLAGS, flags_dict
from zerobridge.translate.trainer_read import read_trainer
from zerobridge.translate.trainer_write import TrainerLaunch

ALPACA = """#!/bin/bash
# an Alpaca-style fine-tuning run
export WANDB_MODE=offline
torchrun --nproc_per_node=8 --master_port=20001 train.py \\
    --model_name_or_path $MODEL_PATH \\
    --data_path ./alpaca_data.json \\
    --bf16 True \\
    --output_dir out \\
    --num_train_epochs 3 \\
    --per_device_train_batch_size 2 \\
    --gradient_accumulation_steps 32 \\
    --learning_rate 2e-5 --weight_decay 0. --warmup_ratio 0.03 --lr_scheduler_type "cosine" \\
    --fsdp "full_shard auto_wrap" \\
    --fsdp_transformer_layer_cls_to_wrap 'LlamaDecoderLayer' \\
    --gradient_checkpointing True
"""

TRAINER_SCRIPTS = [p for p in corpus_files("trainer") if p.suffix == ".sh"]
ZERO2 = "deepspeed/axolotl-ai-cloud__axolotl__deepspeed_configs__zero2.json"
"""A ZeRO-2 JSON of the corpus (with "auto" values) for the script that names its config in a shell variable."""


def script(tmp_path: Path, text: str = ALPACA, name: str = "train.sh") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def in_layout(path: Path, tmp_path: Path) -> Path:
    """A corpus script beside the fsdp_config it names (the corpus keeps it under its long name)."""
    if "Scicom" not in path.name:
        return path
    here = tmp_path / "layout"
    here.mkdir(exist_ok=True)
    shutil.copy(path, here / path.name)
    config = next(p for p in corpus_files("trainer") if p.suffix == ".json")
    shutil.copy(config, here / "fsdp-gpt-oss.json")
    return here / path.name


@pytest.fixture
def shell_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable FastChat's LoRA script names its DeepSpeed config with, set as its caller would."""
    root = corpus_dir()
    if root is not None:
        monkeypatch.setenv("PATH_TO_DEEPSPEED_CONFIG_S2", str(root / ZERO2))


# ----------------------------------------------------------------------------------------- reading


def test_alpaca_script_reads_as_trainer_runs_it(tmp_path: Path) -> None:
    t = load_spec(script(tmp_path))
    spec = t.value
    assert spec.sharding.stage.value == 3 and spec.sharding.parameters.value == "reshard_after_forward"
    assert spec.wrapping.layer_classes == ("LlamaDecoderLayer",)
    assert spec.checkpoint.activation_checkpointing
    assert (spec.batch.micro_batch_size, spec.batch.accumulation_steps, spec.batch.clip_grad_norm) == (2, 32, 1.0)
    assert spec.precision.param_dtype.value == "bf16"
    assert "deprecated" in t.report.find("fsdp").note and "FSDP2" in t.report.find("fsdp").note
    assert "deprecated" in t.report.find("fsdp_transformer_layer_cls_to_wrap").note
    assert "deprecated" in t.report.find("warmup_ratio").note
    unknown = t.report.find("model_name_or_path")
    assert unknown.status is Status.NOT_ABOUT_SHARDING and "ignored" in unknown.note
    assert spec.passthrough["trainer"]["model_name_or_path"] == "$MODEL_PATH"  # kept as written
    assert spec.passthrough["trainer"]["warmup_steps"] == "0.03"  # 5.x reads a ratio below 1 there
    assert len(t.report.warnings) <= 3


def test_shell_forms() -> None:
    text = """set -e
MODEL=x
CUDA_VISIBLE_DEVICES=0,1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 \\
  -m my.train --per-device-train-batch-size=4 --run_name "a b" --seed -1 \\
  --fsdp_config '{"version": 2}' --data "$DATA/x"   # a comment
"""
    located = parse_launch_script(text, "run.sh")
    assert located.command is not None and located.command.launcher == "torchrun"
    assert located.command.script == "my.train" and located.command.world_size == 8
    assert located.data == {"per_device_train_batch_size": "4", "run_name": "a b", "seed": "-1",
                            "fsdp_config": '{"version": 2}', "data": "$DATA/x"}
    assert located.lines["fsdp_config"] == 5
    ds = parse_launch_script("deepspeed --num_gpus 6 --num_nodes 2 t.py --fp16\n", "d.sh").command
    assert ds is not None and ds.world_size == 12
    acc = parse_launch_script("accelerate launch --num_processes 4 --multi_gpu t.py --bf16\n", "a.sh")
    assert acc.command is not None and acc.command.world_size == 4 and acc.data == {"bf16": True}
    named = read_trainer(parse_launch_script("accelerate launch --config_file fsdp.yaml t.py --bf16\n", "c.sh"))
    assert named.report.find("(accelerate launch --config_file)").status is Status.IGNORED
    arrays = parse_launch_script('torchrun "${DIST[@]}" "$ROOT/train.py" config.yaml \\\n  --fsdp '
                                 '"shard_grad_op auto_wrap" "${EVAL[@]}" --max_grad_norm 0.5 2>&1 | tee log\n', "t.sh")
    assert arrays.command is not None and arrays.command.script == "$ROOT/train.py"
    assert arrays.data == {"fsdp": "shard_grad_op auto_wrap", "max_grad_norm": "0.5"}
    flags = parse_flags_file("# flags\n--fsdp\n--fsdp_config fsdp.json\n--bf16 true\n", "f.args")
    assert flags.data == {"fsdp": True, "fsdp_config": "fsdp.json", "bf16": "true"}


def test_trainer_json_and_inline_config(tmp_path: Path) -> None:
    args = {"output_dir": "out", "fsdp": "shard_grad_op auto_wrap offload", "per_device_train_batch_size": 4,
            "fsdp_config": {"fsdp_min_num_params": 1000000, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}}
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(args), encoding="utf-8")
    t = load_spec(path)
    assert t.value.sharding.parameters.value == "reshard_after_backward"
    assert t.value.offload.parameters.enabled and t.value.wrapping.min_params == 1000000
    assert "deprecated prefix" in t.report.find("fsdp_config.fsdp_min_num_params").note
    yaml_args = tmp_path / "args.yaml"
    yaml_args.write_text("output_dir: out\nfsdp: true\nfsdp_config: {version: 2, cpu_offload: true}\nbf16: true\n",
                         encoding="utf-8")
    from_yaml = load_spec(yaml_args)
    assert from_yaml.value.offload.parameters.enabled and from_yaml.value.precision.param_dtype.value == "bf16"
    inline = load_spec(script(tmp_path, "python train.py --fsdp --fsdp_config '{\"reshard_after_forward\": false}'\n"))
    assert inline.value.sharding.parameters.value == "reshard_after_backward"
    assert inline.report.find("fsdp").status is Status.EXACT


def test_deepspeed_json_autos_filled_from_the_flags(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(ds), encoding="utf-8")
    path = script(tmp_path, "deepspeed train.py --deepspeed ds.json --per_device_train_batch_size 4 "
                            "--gradient_accumulation_steps 8 --max_grad_norm 0.5 --bf16\n")
    t = load_spec(path)
    assert t.value.sharding.stage.value == 2
    assert (t.value.batch.micro_batch_size, t.value.batch.accumulation_steps) == (4, 8)
    assert t.value.batch.clip_grad_norm == 0.5 and t.value.precision.param_dtype.value == "bf16"
    assert "train_micro_batch_size_per_gpu=4" in t.report.find("deepspeed").note


def test_bad_scripts_name_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    none = script(tmp_path, "#!/bin/bash\n\necho hello\nls -l\n", "none.sh")
    with pytest.raises(ConfigError, match="no training command") as exc:
        load_spec(none)
    assert exc.value.line == 3
    both = script(tmp_path, "torchrun t.py \\\n  --fsdp full_shard \\\n  --deepspeed ds.json\n", "both.sh")
    assert main(["convert", str(both), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert f"{both}:3" in err and "--fsdp and --deepspeed together" in err and "fix:" in err
    assert main(["convert", str(none), "--to", "trainer-fsdp"]) == 2
    assert f"{none}:3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="shell variable that is not set"):
        read_trainer(parse_launch_script("deepspeed t.py --deepspeed $NOT_SET_ANYWHERE\n", "v.sh"))
    with pytest.raises(ConfigError, match=r"--per_device_train_batch_size '\$BS' is not a number") as exc:
        read_trainer(parse_launch_script("torchrun t.py \\\n --fsdp --per_device_train_batch_size $BS\n", "b.sh"))
    assert exc.value.line == 2
    with pytest.raises(ConfigError, match="FSDP1-only"):
        read_trainer(parse_launch_script("torchrun t.py --fsdp 'hybrid_shard auto_wrap'\n", "h.sh"))


# ------------------------------------------------------------------------------------------ consumers


def parsed(pieces: tuple[str, ...], tmp_path: Path) -> tuple[Any, list[str]]:
    """``TrainingArguments`` from the flags as a Trainer script parses them, and the flags it leaves to the
    script's own dataclasses."""
    from transformers import HfArgumentParser, TrainingArguments

    flags = flags_dict(pieces)
    flags.pop("--tf32", None)  # a GPU-only switch: TrainingArguments refuses it on this CPU
    on_cpu = [piece for flag, values in flags.items() for piece in (flag, *values)]
    args, rest = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none", *on_cpu],
        return_remaining_strings=True)
    return args, rest


def training_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def meant_plugin(config: dict[str, Any]) -> dict[str, Any]:
    """The ``fsdp_plugin_args`` transformers should build from a written fsdp_config (FSDP2)."""
    out = {"fsdp_version": config["version"], "auto_wrap_policy": config["auto_wrap_policy"],
           "cpu_ram_efficient_loading": config.get("cpu_ram_efficient_loading", False),
           "state_dict_type": config.get("state_dict_type", "FULL_STATE_DICT"),
           "activation_checkpointing": config["activation_checkpointing"],
           "reshard_after_forward": config["reshard_after_forward"]}
    if config["cpu_offload"]:
        out["cpu_offload"] = True
    if "transformer_layer_cls_to_wrap" in config:
        out["transformer_cls_names_to_wrap"] = ",".join(config["transformer_layer_cls_to_wrap"])
    if config.get("min_num_params"):
        out["min_num_params"] = config["min_num_params"]
    return out


def check_fsdp_launch(spec: StrategySpec, tmp_path: Path) -> None:
    """Write ``spec`` as trainer-fsdp; TrainingArguments must parse it into the plugin and run values meant."""
    launch = write(spec, "trainer-fsdp").value
    assert isinstance(launch, TrainerLaunch)
    config_file = tmp_path / "fsdp.json"
    config_file.write_text(json.dumps(launch.config), encoding="utf-8")
    fields = training_fields()
    for pieces in (launch.pieces(str(config_file)), launch.pieces()):  # a file, and the same config inline
        args, rest = parsed(pieces, tmp_path)
        script_own = [flag for flag in flags_dict(pieces) if flag[2:] not in fields]  # the script's dataclasses
        assert [piece for piece in rest if piece.startswith("--")] == script_own
        if not launch.config:
            assert not args.fsdp and spec.sharding.stage == 0
            continue
        assert args.fsdp_plugin_args == meant_plugin(launch.config)
        b = spec.batch
        if isinstance(b.micro_batch_size, int):
            assert args.per_device_train_batch_size == b.micro_batch_size
        if isinstance(b.accumulation_steps, int):
            assert args.gradient_accumulation_steps == b.accumulation_steps
        if b.clip_grad_norm != "auto":
            assert args.max_grad_norm == (b.clip_grad_norm or 0.0)
        dtype = spec.precision.param_dtype
        assert (args.bf16, args.fp16) == (dtype == "bf16", dtype == "fp16")


@pytest.mark.parametrize("name", ["zero3", "zero3-offload", "zero2", "fsdp2-no-reshard", "zero0", "fsdp-full-shard"])
def test_registry_entry_as_trainer_fsdp_is_what_transformers_parses(name: str, tmp_path: Path) -> None:
    check_fsdp_launch(load_spec(name).value, tmp_path)


def test_alpaca_script_round_trips_through_transformers(tmp_path: Path) -> None:
    spec = load_spec(script(tmp_path)).value
    check_fsdp_launch(spec, tmp_path)
    launch = write(spec, "trainer-fsdp").value
    args, _ = parsed(launch.pieces(), tmp_path)
    assert args.warmup_steps == 0.03 and args.lr_scheduler_type == "cosine"
    assert launch.config["activation_checkpointing"]  # FSDP's own, as transformers 5 recommends


@pytest.mark.corpus
def test_every_corpus_config_becomes_trainer_fsdp_flags_transformers_accepts(tmp_path: Path) -> None:
    """Every DeepSpeed and Accelerate config of the corpus, in one test: one TrainingArguments parse each."""
    sources = corpus_files("deepspeed") + corpus_files("accelerate")
    if not sources:
        pytest.skip("no corpus")
    for i, path in enumerate(sources):
        here = tmp_path / str(i)
        here.mkdir()
        check_fsdp_launch(load_spec(in_original_layout(path, here)).value, here)


def deepspeed_check(spec: StrategySpec, tmp_path: Path, model: Any) -> dict[str, Any]:
    """trainer-deepspeed through what Trainer does with --deepspeed; the finalized config."""
    from test_trainer_config import autos, deepspeed_config, trainer_check

    launch = write(spec, "trainer-deepspeed").value
    (tmp_path / "ds.json").write_text(json.dumps(launch.config), encoding="utf-8")
    args, _ = parsed(launch.pieces(str(tmp_path / "ds.json")), tmp_path)  # TrainingArguments reads the file
    config = trainer_check(launch.config, args, model)  # ValueError listing mismatches fails the test
    assert autos(config) == []
    checked = deepspeed_config.DeepSpeedConfig(config, mpu=None)
    assert checked.train_micro_batch_size_per_gpu == args.per_device_train_batch_size
    assert checked.gradient_accumulation_steps == args.gradient_accumulation_steps
    return config


@pytest.fixture(scope="module")
def model() -> Any:
    from zerobridge.testing.trainer_run import tiny_llama

    return tiny_llama()


def test_alpaca_script_becomes_a_deepspeed_json_trainer_accepts(tmp_path: Path, model: Any) -> None:
    config = deepspeed_check(load_spec(script(tmp_path)).value, tmp_path, model)
    assert config["zero_optimization"]["stage"] == 3 and config["bf16"]["enabled"] is True


@pytest.mark.corpus
@pytest.mark.usefixtures("shell_vars")
@pytest.mark.parametrize("path", TRAINER_SCRIPTS, ids=lambda p: p.name)
def test_corpus_script_becomes_a_deepspeed_json_trainer_accepts(path: Path, tmp_path: Path, model: Any) -> None:
    spec = load_spec(in_layout(path, tmp_path)).value
    config = deepspeed_check(spec, tmp_path, model)
    assert config["zero_optimization"]["stage"] == spec.sharding.stage.value


@pytest.mark.corpus
@pytest.mark.usefixtures("shell_vars")
@pytest.mark.parametrize("path", TRAINER_SCRIPTS, ids=lambda p: p.name)
def test_corpus_script_flags_round_trip(path: Path, tmp_path: Path) -> None:
    """flags -> spec -> flags keeps every flag: as itself, in its current name, or (deprecated FSDP flags) as
    its fsdp_config key; the values carried verbatim are the script's."""
    located = parse_launch_script(path.read_text(encoding="utf-8"), str(path))
    spec = load_spec(in_layout(path, tmp_path)).value
    target = "trainer-deepspeed" if "deepspeed" in located.data else "trainer-fsdp"
    launch = write(spec, target).value
    out = flags_dict(launch.pieces("config.json"))
    for name, value in located.data.items():
        if name in DEPRECATED_FLAGS:
            assert name.removeprefix("fsdp_") in launch.config, name
            continue
        flag = f"--{RENAMED_FLAGS.get(name, name)}"
        if flag == "--activation_checkpointing" and target == "trainer-fsdp":
            assert launch.config["activation_checkpointing"] is True
            continue
        assert flag in out, name
        if name in spec.passthrough.get("trainer", {}):
            assert out[flag] == ([] if value is True else [value]), name
    assert len(load_spec(in_layout(path, tmp_path)).report.warnings) <= 3


@pytest.mark.corpus
def test_corpus_fsdp_config_alone_reads_as_the_run_it_configures(tmp_path: Path) -> None:
    path = next(p for p in corpus_files("trainer") if p.suffix == ".json")
    t = load_spec(path)
    assert t.value.wrapping.layer_classes == ("GptOssDecoderLayer",) and t.value.checkpoint.activation_checkpointing
    assert t.report.find("fsdp_config.backward_prefetch").status is Status.IGNORED  # FSDP1-only, Trainer runs FSDP2
    check_fsdp_launch(t.value, tmp_path)
    assert load_spec(script(tmp_path, '{"reshard_after_forward": false}', "kwargs.json")).report.source == "fsdp2"


@pytest.mark.corpus
def test_trainer_corpus_is_there_when_present() -> None:
    if corpus_dir() is None:
        pytest.skip("no corpus")
    assert len(TRAINER_SCRIPTS) >= 5 and any(p.suffix == ".json" for p in corpus_files("trainer"))


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_writes_the_config_and_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = script(tmp_path), tmp_path / "fsdp.json"
    assert main(["convert", str(path), "--to", "trainer-fsdp", "-o", str(out)]) == 0
    stdout, err = capsys.readouterr()
    assert stdout.count("\n") == 1 and stdout.startswith(f"--fsdp --fsdp_config {out} ")
    assert json.loads(out.read_text())["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert err.count("zerobridge: warning") <= 3
    assert main(["convert", str(path), "--to", "trainer-deepspeed"]) == 0  # no -o: the JSON inline
    stdout, _ = capsys.readouterr()
    assert stdout.startswith("--deepspeed '{") and stdout.count("\n") == 1
