"""The zerobridge command: outputs, exit codes, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerobridge.cli import main

DS_ZERO3 = ('{\n  // a DeepSpeed config\n  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},\n'
            '  "bf16": {"enabled": true},\n}\n')


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ds_file(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(DS_ZERO3)
    return path


def test_convert_to_deepspeed_and_back_through_spec(capsys: pytest.CaptureFixture[str], ds_file: Path,
                                                    tmp_path: Path) -> None:
    code, out, _ = run(capsys, "convert", str(ds_file), "--to", "spec")
    assert code == 0
    spec = json.loads(out)
    assert spec["sharding"]["parameters"] == "reshard_after_forward" and spec["precision"]["param_dtype"] == "bf16"
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(out)
    code, out, _ = run(capsys, "convert", str(spec_file), "--to", "deepspeed")
    ds = json.loads(out)
    assert code == 0 and ds["zero_optimization"]["offload_param"]["device"] == "cpu" and ds["bf16"]["enabled"]


def test_explain_flag_prints_the_report_on_stderr_only(capsys: pytest.CaptureFixture[str], ds_file: Path) -> None:
    code, out, err = run(capsys, "convert", str(ds_file), "--to", "deepspeed", "--explain")
    assert code == 0
    json.loads(out)  # stdout stays machine-readable
    assert "zero_optimization.stage" in err and "deepspeed -> spec" in err and "spec -> deepspeed" in err


def test_output_file_is_written_atomically(capsys: pytest.CaptureFixture[str], ds_file: Path, tmp_path: Path) -> None:
    target = tmp_path / "out" / "ds.json"
    code, out, _ = run(capsys, "convert", str(ds_file), "--to", "deepspeed", "-o", str(target))
    assert code == 0 and out == "" and json.loads(target.read_text())["zero_optimization"]["stage"] == 3
    assert [p.name for p in target.parent.iterdir()] == ["ds.json"]  # no temp files left


def test_strict_turns_approximations_into_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hybrid.json"
    path.write_text('{"zero_optimization": {"stage": 3, "mics_shard_size": 4}}')
    code, out, err = run(capsys, "convert", str(path), "--to", "deepspeed")
    assert code == 0 and "warning: sharding.shard_group: approximated" in err
    target = tmp_path / "kept.json"
    target.write_text("earlier result")
    code, out, err = run(capsys, "convert", str(path), "--to", "deepspeed", "--strict", "-o", str(target))
    assert code == 1 and "--strict" in err and out == ""
    assert target.read_text() == "earlier result"  # a failed run leaves earlier results intact


def test_registry_names_are_sources(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "convert", "zero2-offload", "--to", "deepspeed")
    zero = json.loads(out)["zero_optimization"]
    assert code == 0 and zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"


def test_explain_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "zero3", "--params", "7.5e9", "--world-size", "64", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["world_size"] == 64 and data["params"] == 7_500_000_000


def test_diff(capsys: pytest.CaptureFixture[str], ds_file: Path, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "diff", "zero3", "stage3")
    assert code == 0 and out.startswith("same run")
    code, out, _ = run(capsys, "diff", "zero3", str(ds_file))
    assert code == 1 and "precision.param_dtype" in out and "offload.parameters.device" in out


def test_strategies_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "strategies")
    lines = out.splitlines()
    assert code == 0 and len(lines) >= 20
    assert any(line.startswith("zero3 ") and "stage 3" in line for line in lines)


@pytest.mark.parametrize("argv, fragments", [
    (["convert", "missing.json", "--to", "fsdp2"], ["missing.json", "file not found"]),
    (["convert", "zero33", "--to", "deepspeed"], ["'zero33'", "did you mean 'zero3'"]),
    (["convert", "{bad}.json", "--to", "deepspeed"], ["file not found"]),
    (["explain", "zero3", "--params", "lots", "--world-size", "8"], ["expected a number"]),
    (["convert", "zero3", "--to", "fsdp3"], ["invalid choice: 'fsdp3'"]),
])
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], fragments: list[str]) -> None:
    with pytest.raises(SystemExit) if argv[-1] in ("8", "fsdp3") else _no_raise():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err
    assert "Traceback" not in err


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@pytest.mark.parametrize("text, fragments", [
    ('{"zero_optimization": {"stage": 3,, }}', ["bad.json:1:", "not valid JSON/HJSON"]),
    ('{"zero_optimization": {"stage": 3, "overlap_comms": true}}',
     ["bad.json:1", "zero_optimization.overlap_comms", "did you mean 'overlap_comm'"]),
    ('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}',
     ["not a multiple of"]),
])
def test_bad_files_exit_2_without_traceback(tmp_path: Path, text: str, fragments: list[str]) -> None:
    """A real process: exit code 2, one clear message, no traceback."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "zerobridge.cli", "convert", str(path), "--to", "fsdp2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for fragment in fragments:
        assert fragment in proc.stderr


@pytest.mark.parametrize("name, text", [
    ("empty.json", ""), ("blank.json", "  \n\t\n"), ("null.json", "null\n"), ("empty.yaml", ""),
    ("null.yaml", "---\nnull\n"), ("comments.yaml", "# nothing but a comment\n"), ("empty.toml", "\n"),
])
def test_an_empty_file_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str) -> None:
    """A file with no settings is almost always a failed write: exit 2, never every default."""
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run(capsys, "convert", str(path), "--to", "fsdp2")
    assert code == 2 and out == ""
    assert f"{path} is empty" in err and "fix:" in err and "Traceback" not in err


def test_json_only_hjson_reads_is_read_with_a_warning_naming_the_line(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2}\n  "bf16": {"enabled": true}\n}\n')  # missing comma
    code, out, err = run(capsys, "convert", str(path), "--to", "deepspeed")
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 2  # read as DeepSpeed reads it
    assert f"warning: {path}: syntax: line 3" in err and "Accelerate" in err and "json" in err
    assert run(capsys, "convert", str(path), "--to", "deepspeed", "--strict")[0] == 0  # syntax changes nothing
    path.write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
    assert "syntax" not in run(capsys, "convert", str(path), "--to", "deepspeed")[2]


def test_world_size_fills_accelerate_and_deepspeed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import yaml

    code, out, err = run(capsys, "convert", "zero3", "--to", "accelerate-fsdp")
    assert code == 0 and "num_processes" not in yaml.safe_load(out)
    assert "pass --world-size N to zerobridge convert, or --num_processes N to accelerate launch" in \
        run(capsys, "convert", "zero3", "--to", "accelerate-fsdp", "--explain")[2]
    for target in ("accelerate-fsdp", "accelerate-deepspeed"):
        code, out, _ = run(capsys, "convert", "zero3", "--to", target, "--world-size", "8")
        assert code == 0 and yaml.safe_load(out)["num_processes"] == 8
    code, out, _ = run(capsys, "convert", "mics", "--to", "accelerate-fsdp", "--world-size", "16")
    written = yaml.safe_load(out)
    assert written["num_processes"] == 16 and written["parallelism_config"]["parallelism_config_dp_shard_size"] == 8
    source = tmp_path / "ds.json"
    source.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4, '
                      '"gradient_accumulation_steps": 2}')
    code, out, _ = run(capsys, "convert", str(source), "--to", "deepspeed", "--world-size", "8")
    assert code == 0 and json.loads(out)["train_batch_size"] == 64  # 4 x 2 x 8
    code, out, _ = run(capsys, "convert", str(source), "--to", "deepspeed")
    assert "train_batch_size" not in json.loads(out)  # DeepSpeed derives it from the launcher's world size


@pytest.mark.parametrize("argv, fragments", [
    (["mics", "--world-size", "12"], ["--world-size: sharding.shard_group=8 does not divide the world size 12"]),
    (["zero3-hpz", "--world-size", "3"], ["--world-size: sharding.backward_gather_group=8 does not divide"]),
])
def test_world_size_that_does_not_fit_is_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                   fragments: list[str]) -> None:
    code, out, err = run(capsys, "convert", *argv, "--to", "accelerate-fsdp")
    assert code == 2 and out == "" and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_world_size_against_the_source_s_own_overrides_it_with_a_warning(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    import yaml

    source = tmp_path / "accelerate.yaml"
    source.write_text("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n")
    code, out, err = run(capsys, "convert", str(source), "--to", "accelerate-fsdp", "--world-size", "8")
    assert code == 0 and yaml.safe_load(out)["num_processes"] == 8  # as accelerate launch --num_processes 8
    assert "warning: sharding.world_size: overridden" in err and "replaces the source's 4" in err
    assert run(capsys, "convert", str(source), "--to", "accelerate-fsdp", "--world-size", "8", "--strict")[0] == 0
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, '
                  '"gradient_accumulation_steps": 2}')
    code, out, err = run(capsys, "convert", str(ds), "--to", "deepspeed", "--world-size", "4")
    assert code == 0 and "global batch" not in err  # the source states no world size: nothing overridden
    assert json.loads(out)["train_batch_size"] == 64


# --- run-level keys, reports that rank what matters, the Trainer form --------------------------------------------

ACCELERATE_FSDP = "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"

ZERO2_AUTO = json.dumps({  # the shape of transformers' tests/deepspeed/ds_config_zero2.json
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False})


def warning_keys(err: str) -> list[str]:
    return [line.split(": ")[2] for line in err.splitlines() if line.startswith("zerobridge: warning: ")]


def test_accelerate_fsdp_to_deepspeed_leaves_run_level_keys_to_the_trainer(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    source = tmp_path / "fsdp.yaml"
    source.write_text(ACCELERATE_FSDP)
    code, out, err = run(capsys, "convert", str(source), "--to", "deepspeed")
    ds = json.loads(out)
    assert code == 0 and "gradient_clipping" not in warning_keys(err)
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == \
        ("auto", "auto", "auto")
    assert ds["bf16"]["enabled"] is True  # stated by the source: kept (Trainer then needs --bf16)


def test_run_level_flags_make_a_config_plain_deepspeed_initialize_reads(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
    capsys.readouterr()  # what importing DeepSpeed logs (its accelerator, without DS_ACCELERATOR) is not convert's
    source = tmp_path / "fsdp.yaml"
    source.write_text(ACCELERATE_FSDP)
    # --model: the buckets FSDP leaves to the engine, sized for the model ("auto" without it, issue 31)
    code, out, err = run(capsys, "convert", str(source), "--to", "deepspeed", "--micro-batch", "4",
                         "--accumulation", "2", "--clip", "1.0", "--precision", "fp32", "--model", "tiny-llama")
    ds = json.loads(out)
    assert code == 0 and "auto" not in out
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"],
            ds["train_batch_size"], ds["bf16"]["enabled"]) == (4, 2, 1.0, 16, False)  # 4 x 2 x num_processes 2
    assert "warning: precision.param_dtype: overridden" in err and "replaces the source's bf16" in err
    # DeepSpeedConfig checks batch = micro x accumulation x world at world 1 here (no process group)
    checked = deepspeed_config.DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    assert (checked.train_micro_batch_size_per_gpu, checked.gradient_accumulation_steps) == (4, 2)
    assert checked.gradient_clipping == 1.0 and not checked.bfloat16_config.enabled
    code, out, _ = run(capsys, "convert", str(source), "--to", "deepspeed", "--clip", "0")
    assert code == 0 and json.loads(out)["gradient_clipping"] == 0.0
    with pytest.raises(SystemExit) as exited:  # argparse's own exit 2
        main(["convert", str(source), "--to", "deepspeed", "--clip", "-1"])
    assert exited.value.code == 2 and "expected a bound >= 0" in capsys.readouterr().err


def test_convert_needs_a_target(capsys: pytest.CaptureFixture[str], ds_file: Path) -> None:
    code, out, err = run(capsys, "convert", str(ds_file))
    assert code == 2 and out == "" and "convert needs --to FORMAT, --trainer-args or --trainer-code" in err


def test_hf_zero2_to_accelerate_fsdp_warns_only_what_changes_the_run(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    source = tmp_path / "ds_config_zero2.json"
    source.write_text(ZERO2_AUTO)
    code, out, err = run(capsys, "convert", str(source), "--to", "accelerate-fsdp")
    # bucket, prefetch and live-parameter settings change memory (issue 31): DeepSpeed preallocates its buckets
    memory = ["communication.reduce_bucket", "communication.allgather_bucket", "communication.prefetch_bucket",
              "communication.max_live_parameters", "communication.persistence_threshold"]
    assert code == 0 and warning_keys(err) == ["sharding", "offload", *memory, "scheduler"]
    scheduler = next(line for line in err.splitlines() if line.startswith("zerobridge: warning: scheduler"))
    assert "(numbers)" in scheduler and "--lr_scheduler_type constant_with_warmup" in scheduler
    assert f"zerobridge convert {source} --trainer-args" in scheduler  # the user's own path, ready to run
    note = [line for line in err.splitlines() if line.startswith("zerobridge: note: ")]
    assert len(note) == 1 and "change only speed" in note[0] and "--explain lists them" in note[0]
    explained = run(capsys, "convert", str(source), "--to", "accelerate-fsdp", "--explain")[2]
    for key in ("communication.reduce_bucket", "optimizer", "batch.clip_grad_norm", "zero_optimization.stage"):
        assert key in explained
    assert "(speed)" in explained and "(memory)" in explained


@pytest.mark.parametrize("target, fix", [
    ("accelerate-fsdp", "--lr_scheduler_type"), ("accelerate-deepspeed", "--lr_scheduler_type"),
    ("fsdp1", "--lr_scheduler_type"), ("fsdp2", "--lr_scheduler_type"), ("lightning", "configure_optimizers"),
])
def test_every_target_that_drops_the_scheduler_says_how_to_keep_it(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path, target: str, fix: str) -> None:
    source = tmp_path / "ds.json"
    source.write_text('{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2, '
                      '"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, '
                      '"warmup_num_steps": 10, "warmup_type": "linear"}}}')
    code, _, err = run(capsys, "convert", str(source), "--to", target)
    line = next(x for x in err.splitlines() if x.startswith("zerobridge: warning: scheduler"))
    assert code == 0 and fix in line and "WarmupDecayLR" in line


def test_no_scheduler_no_optimizer_no_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "ds.json"
    source.write_text('{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}')
    _, _, err = run(capsys, "convert", str(source), "--to", "fsdp2")
    assert not {"optimizer", "scheduler"} & set(warning_keys(err))


def test_trainer_args_is_one_line_trainer_parses(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "ds.json"
    source.write_text(json.dumps({
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 50,
                                                          "warmup_max_lr": 3e-4, "warmup_type": "linear"}}}))
    code, out, err = run(capsys, "convert", str(source), "--to", "accelerate-fsdp", "--trainer-args")
    assert code == 0 and out.count("\n") == 1 and "not printed beside the trainer output: pass -o FILE" in err
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses([*out.split(), "--output_dir", str(tmp_path), "--use_cpu", "true"])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_grad_norm, args.bf16) == \
        (4, 2, 0.5, True)
    assert (args.optim.value, args.learning_rate, args.adam_beta2, args.weight_decay) == ("adamw_torch", 3e-4, 0.95, 0)
    assert (args.lr_scheduler_type.value, args.warmup_steps, args.max_steps) == ("linear", 50, 1000)
    written = tmp_path / "fsdp.yaml"
    code, again, _ = run(capsys, "convert", str(source), "--to", "accelerate-fsdp", "-o", str(written),
                         "--trainer-args")
    assert code == 0 and again == out and written.read_text().startswith("compute_environment")


def test_trainer_args_without_sections_or_stated_values_is_an_empty_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "convert", "zero3", "--trainer-args")
    assert code == 0 and out == "\n"  # a name leaves everything to Trainer's own arguments


def test_trainer_code_builds_deepspeed_s_schedule(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    source = tmp_path / "ds.json"
    source.write_text('{"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 1, '
                      '"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, '
                      '"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}')
    code, out, _ = run(capsys, "convert", str(source), "--trainer-code")
    assert code == 0
    scope: dict[str, object] = {"model": torch.nn.Linear(2, 2)}
    exec(out, scope)
    optimizer, scheduler = scope["optimizer"], scope["scheduler"]
    reference_opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.01)
    reference = lr_schedules.WarmupLR(reference_opt, warmup_max_lr=0.01, warmup_num_steps=5)  # log warmup
    ours, theirs = [], []
    for _ in range(8):
        ours.append(optimizer.param_groups[0]["lr"])
        theirs.append(reference_opt.param_groups[0]["lr"])
        optimizer.step(), scheduler.step(), reference_opt.step(), reference.step()
    assert ours == pytest.approx(theirs, rel=1e-12) and len(set(theirs)) > 3


def test_demo_round_trip_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    """`zerobridge demo` exits 0: the DeepSpeed JSON it writes reads back to the same strategy, and
    only the run-level batch keys the writer leaves "auto" on purpose differ from the registry's."""
    code, out, _ = run(capsys, "demo")
    assert code == 0, out
    assert "same run: zero3-offload as DeepSpeed JSON and that JSON written and read once more" in out
    assert "changed on the way" not in out


def test_convert_report_texts_name_what_fixes_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33 item 16: each warning's fix is about its own key."""
    bf16 = tmp_path / "bf16.json"
    bf16.write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 3}}')
    _, _, err = run(capsys, "convert", str(bf16), "--to", "accelerate-fsdp")
    skipping = next(line for line in err.splitlines() if "skip_nonfinite_steps" in line)
    assert "mixed_precision_policy" not in skipping and "clip_grad_norm_" in skipping
    _, _, err = run(capsys, "convert", "zero3-offload", "--to", "accelerate-fsdp")
    assert "warning: name:" not in err  # the registry name is a label, not a setting
    code, _, err = run(capsys, "convert", "mics", "--to", "fsdp2", "--world-size", "12")
    assert code == 2 and "shard_group=8 does not divide the world size 12" in err and "global" not in err


_CONSOLE = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('handlers ran'))\n"
            "if sys.argv[1] == 'thread':\n"
            "    threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
            "sys.argv = ['zerobridge'] + sys.argv[2:]\n"
            "from zerobridge.cli import console\n"
            "console()\n")


@pytest.mark.parametrize("thread", ["thread", "none"])
def test_the_console_script_exits_with_mains_code_after_the_exit_handlers(thread: str, tmp_path: Path) -> None:
    """``zerobridge`` (``cli.console``) leaves out the interpreter's teardown, not its exit handlers, its
    buffered output or a thread still running."""
    ok = subprocess.run([sys.executable, "-c", _CONSOLE, thread, "strategies"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "zero3-offload" in ok.stdout
    assert ok.stdout.rstrip().endswith("handlers ran")
    assert ("thread done" in ok.stdout) == (thread == "thread")
    bad = subprocess.run([sys.executable, "-c", _CONSOLE, thread, "explain", str(tmp_path / "missing.json"),
                          "--params", "1e9", "--world-size", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "zerobridge: error" in bad.stderr and "handlers ran" in bad.stdout
