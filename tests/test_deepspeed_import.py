"""``import_deepspeed_checkpoint`` on checkpoints written by real DeepSpeed on CPU.

One gloo group of two ranks trains ParityNet (uneven sizes, a tied
embedding/head, a frozen layer, an unused parameter, two param groups) under
DeepSpeed ZeRO stages 0-3 for 4 steps, saves, and trains four more steps. Each
import is checked against DeepSpeed's own reconstruction (``zero_to_fp32``),
DeepSpeed's live per-parameter API at save time, the single-process
``run_reference`` and a single-process torch AdamW run (parameters and
optimizer state). The error cases work on copies of those checkpoints.
Finally ``zerobridge checkpoint import-deepspeed`` converts them and the
native engine, at another stage, continues where DeepSpeed went on; a run
with a JSON ``WarmupLR`` and a ``client_state`` continues with the same lrs,
its torch-equivalent scheduler restored from DeepSpeed's state.

The worker functions near the end run on the ranks of a ``Cluster``
(spawned processes import this module by name).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

from zerobridge.checkpoint.deepspeed_import import import_deepspeed_checkpoint
from zerobridge.checkpoint.run_state import restore_scheduler
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.testing.deepspeed_run import AdamWReference, DeepSpeedRun, reference_adamw
from zerobridge.testing.parity import ParityNet, run_reference
from zerobridge.translate.report import Status

os.environ.setdefault("DS_ACCELERATOR", "cpu")
zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")

pytestmark = pytest.mark.distributed

SAVED_AT, STEPS = 4, 8
LR, WEIGHT_DECAY = 3e-2, 0.1  # zerobridge.testing.parity.make_optimizer("adamw")
BUFFERED = "zerobridge.testing.deepspeed_run:BufferedParityNet"
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
CASES: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1, "client_state": {"epoch": 3}},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    # Round-robin order, per-parameter alignment padding, elastic optimizer state.
    "zero2_layout": {"stage": 2, "zero": {"round_robin_gradients": True, "parameter_alignment": True,
                                          "elastic_checkpoint": True}},
    # Several sub-groups per param group, and buffers.
    "zero3_subgroups": {"stage": 3, "zero": {"sub_group_size": 300}, "model_factory": BUFFERED},
    "zero2_bf16": {"stage": 2, "dtype": "bf16"},
    # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16 optimizer, a different file layout.
    "zero1_bf16_optimizer": {"stage": 1, "dtype": "bf16", "extra": {"data_types": {"grad_accum_dtype": "fp32"}}},
}
FP32 = ["zero1", "zero2", "zero3", "zero2_layout", "zero3_subgroups"]
UNUSED = ("unused.weight", "unused.bias")
ME = "test_deepspeed_import"
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 6,
                                         "warmup_type": "linear"}}
"""A JSON scheduler still warming up when the checkpoint is written, so every later lr differs."""
SCHEDULED: dict[str, Any] = {"stage": 2, "extra": {"scheduler": WARMUP},
                             "client_state": {"epoch": 3, "seen": [1, 2, 3], "best": {"loss": 2.5}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, DeepSpeedRun]]]:
    root = tmp_path_factory.mktemp("deepspeed")
    made: dict[str, tuple[Path, DeepSpeedRun]] = {}
    with Cluster(2, timeout_s=300, env=ENV) as cluster:  # the first run may JIT-build DeepSpeed's shm op
        for name, kwargs in CASES.items():
            results = cluster.run("zerobridge.testing.deepspeed_run:train_deepspeed", steps=STEPS,
                                  save_dir=str(root / name), save_after=SAVED_AT, **kwargs)
            made[name] = (root / name, results[0])  # type: ignore[assignment]
        results = cluster.run("zerobridge.testing.deepspeed_run:train_deepspeed", steps=STEPS,
                              save_dir=str(root / "scheduled"), save_after=SAVED_AT, **SCHEDULED)
        made["scheduled"] = (root / "scheduled", results[0])  # type: ignore[assignment]
        cluster.run("zerobridge.testing.deepspeed_run:train_deepspeed", stage=0, steps=1,
                    save_dir=str(root / "zero0"), collect=False)
    yield made | {"zero0": (root / "zero0", DeepSpeedRun())}


@cache
def torch_adamw(model_factory: str | None = None) -> AdamWReference:
    return reference_adamw(steps=SAVED_AT, model_factory=model_factory)


def copy_of(runs: dict[str, tuple[Path, DeepSpeedRun]], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[name][0], tmp_path / name))


@pytest.mark.parametrize("name", CASES)
def test_weights_equal_deepspeeds_own_reconstruction(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                     name: str) -> None:
    directory, run = runs[name]
    state, _ = import_deepspeed_checkpoint(directory)
    assert run.tag == state.metadata["tag"] == f"global_step{SAVED_AT}"
    for fqn, live in run.saved_params.items():  # DeepSpeed's live fp32 masters at save time, bit for bit
        assert torch.equal(state.model[fqn], live), fqn
    if name != "zero1_bf16_optimizer":  # zero_to_fp32 cannot read the BF16 optimizer's files
        oracle = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory))
        for fqn, value in oracle.items():
            assert torch.equal(state.model[fqn], value.float()), fqn
        # zero_to_fp32 loses stage 1's frozen weights (it only reads frozen_param_fragments).
        lost = {"frozen.weight", "frozen.bias"} if CASES[name]["stage"] == 1 else set()
        assert set(state.model) - set(oracle) == lost
    assert state.model["head.weight"] is state.model["embed.weight"]
    assert all(v.dtype == torch.float32 for v in state.model.values() if v.is_floating_point())


@pytest.mark.parametrize("name", [n for n in FP32 if n != "zero3_subgroups"])
def test_weights_match_single_process_reference(runs: dict[str, tuple[Path, DeepSpeedRun]], name: str) -> None:
    state, _ = import_deepspeed_checkpoint(runs[name][0])
    ref = run_reference(steps=SAVED_AT).state
    assert set(state.model) == set(ref)
    for fqn, value in ref.items():
        if fqn != "unused.weight":
            torch.testing.assert_close(state.model[fqn], value, rtol=0, atol=1e-5, msg=fqn)
    # DeepSpeed steps the unused weight with a zero gradient: decoupled decay only.
    decayed = ParityNet(0).unused.weight.detach() * (1 - LR * WEIGHT_DECAY) ** SAVED_AT
    torch.testing.assert_close(state.model["unused.weight"], decayed, rtol=0, atol=1e-6)
    assert not torch.allclose(state.model["unused.weight"], ref["unused.weight"], atol=1e-4)


def test_buffers_and_subgroups_match_reference(runs: dict[str, tuple[Path, DeepSpeedRun]]) -> None:
    state, report = import_deepspeed_checkpoint(runs["zero3_subgroups"][0])
    ref = torch_adamw(BUFFERED).state_dict
    assert set(state.model) == set(ref) and "scratch" not in state.model
    assert state.metadata["buffers"] == ["gain", "calls"]
    assert state.model["calls"].dtype == torch.int64 and state.model["calls"].item() == SAVED_AT
    assert torch.equal(state.model["gain"], ref["gain"])
    for fqn, value in ref.items():
        if fqn != "unused.weight":
            torch.testing.assert_close(state.model[fqn], value, rtol=0, atol=1e-5, msg=fqn)
    assert "2 buffers" in report.render()


@pytest.mark.parametrize("name", FP32)
def test_optimizer_state_matches_torch_adamw(runs: dict[str, tuple[Path, DeepSpeedRun]], name: str) -> None:
    state, _ = import_deepspeed_checkpoint(runs[name][0])
    ref = torch_adamw(CASES[name].get("model_factory"))
    assert set(state.optimizer) == set(ref.optimizer) | set(UNUSED)  # not frozen, not the tied alias
    scale = {k: max(s[k].abs().max().item() for s in ref.optimizer.values()) for k in ("exp_avg", "exp_avg_sq")}
    for fqn, want in ref.optimizer.items():
        got = state.optimizer[fqn]
        assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}, fqn
        assert got["step"].dtype == want["step"].dtype == torch.float32 and got["step"].dim() == 0
        assert got["step"].item() == want["step"].item() == SAVED_AT
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].dtype == torch.float32 and got[key].shape == want[key].shape
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6 * scale[key], msg=f"{fqn}.{key}")
    for fqn in UNUSED:  # torch keeps no state for them; DeepSpeed stepped them with zero gradients
        assert state.optimizer[fqn]["step"].item() == SAVED_AT
        assert not state.optimizer[fqn]["exp_avg"].any() and not state.optimizer[fqn]["exp_avg_sq"].any()


@pytest.mark.parametrize("name", CASES)
def test_optimizer_state_equals_deepspeeds_live_state(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                       name: str) -> None:
    directory, run = runs[name]
    state, _ = import_deepspeed_checkpoint(directory)
    assert set(run.saved_optimizer) == set(state.optimizer)
    for fqn, live in run.saved_optimizer.items():
        for key, value in live.items():
            assert torch.equal(state.optimizer[fqn][key], value), f"{fqn}.{key}"


@pytest.mark.parametrize("name", CASES)
def test_param_groups_metadata_and_report(runs: dict[str, tuple[Path, DeepSpeedRun]], name: str) -> None:
    import deepspeed

    state, report = import_deepspeed_checkpoint(runs[name][0])
    ref = torch_adamw(CASES[name].get("model_factory"))
    frozen = ["frozen.weight", "frozen.bias"]
    assert len(state.param_groups) == len(ref.param_groups) == 2
    elastic = name == "zero2_layout"
    for g, (got, want) in enumerate(zip(state.param_groups, ref.param_groups)):
        assert got["params"] == [n for n in want["params"] if n not in frozen]
        assert dict.fromkeys(got["params"], g).items() <= state.metadata["param_group_of"].items()
        hyper = {k: v for k, v in want.items() if k != "params"}
        assert {k: v for k, v in got.items() if k != "params"} == ({} if elastic else hyper)
    approximated = [e.key for e in report.with_status(Status.APPROXIMATED)]
    assert approximated == (["base_optimizer_state.param_groups"] if elastic else [])
    assert [e.key for e in report.with_status(Status.NOT_EXPRESSIBLE)] == []
    assert state.client_state == ({"epoch": 3} if name == "zero1" else {})  # the keys client_state added
    assert [e.key for e in report.with_status(Status.EXACT)] == ["tag", "param_shapes"] + (
        ["client_state"] if name == "zero1" else [])
    assert state.scheduler is None  # DeepSpeed saves lr_scheduler None without a scheduler
    bf16 = CASES[name].get("dtype") == "bf16"
    meta = state.metadata
    assert (meta["source"], meta["zero_stage"], meta["world_size"], meta["global_step"]) == (
        "deepspeed", CASES[name]["stage"], 2, SAVED_AT)
    assert meta["ds_version"] == deepspeed.__version__ and meta["precision"] == ("bf16" if bf16 else "fp32")
    assert meta["loss_scale"] == (None if name == "zero1_bf16_optimizer" else 1.0)
    assert meta["frozen"] == frozen and meta["shared"] == {"head.weight": "embed.weight"}
    assert [e.key for e in report.with_status(Status.EQUIVALENT)] == (["module"] if bf16 else [])


def test_refuses_a_malicious_pickle_without_running_it(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                       tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    directory = copy_of(runs, "zero2", tmp_path)
    victim = directory / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload()}, victim)
    torch.load(victim, weights_only=False)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ConfigError, match=r"refuses to unpickle (builtins\.)?exec:") as caught:
        import_deepspeed_checkpoint(directory)
    assert not marker.exists()
    assert str(victim) in str(caught.value) and "fix:" in str(caught.value)


def test_missing_rank_file(runs: dict[str, tuple[Path, DeepSpeedRun]], tmp_path: Path) -> None:
    directory = copy_of(runs, "zero3", tmp_path)
    gone = directory / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    with pytest.raises(ConfigError, match="rank file missing for data-parallel rank 1 of 2") as caught:
        import_deepspeed_checkpoint(directory)
    assert str(gone) in str(caught.value)


def test_extra_rank_file_is_a_world_size_mismatch(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                  tmp_path: Path) -> None:
    tag_dir = copy_of(runs, "zero2", tmp_path) / "global_step4"
    rank1 = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(rank1, tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(ConfigError, match="3 rank files but partition_count says world size 2"):
        import_deepspeed_checkpoint(tag_dir)


def test_tags_latest_and_tag_directory(runs: dict[str, tuple[Path, DeepSpeedRun]], tmp_path: Path) -> None:
    directory = copy_of(runs, "zero1", tmp_path)
    with pytest.raises(ConfigError, match=r"no checkpoint tag 'global_step99'[\s\S]*global_step4"):
        import_deepspeed_checkpoint(directory, tag="global_step99")
    (directory / "latest").unlink()
    with pytest.raises(ConfigError, match=r"no 'latest' file and no tag given[\s\S]*global_step4"):
        import_deepspeed_checkpoint(directory)
    by_tag, _ = import_deepspeed_checkpoint(directory, tag="global_step4")
    by_dir, _ = import_deepspeed_checkpoint(directory / "global_step4")
    assert all(torch.equal(by_tag.model[k], v) for k, v in by_dir.model.items())


@pytest.mark.parametrize("kind,message", [
    ("tensor_parallel", "tensor-parallel checkpoint"),
    ("pipeline_parallel", "pipeline-parallel checkpoint"),
    ("universal", "universal checkpoint"),
    ("universal_latest", "universal checkpoint"),
])
def test_unsupported_layouts_are_refused(runs: dict[str, tuple[Path, DeepSpeedRun]], tmp_path: Path, kind: str,
                                         message: str) -> None:
    directory = copy_of(runs, "zero2", tmp_path)
    tag_dir = directory / "global_step4"
    if kind == "tensor_parallel":
        shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "mp_rank_01_model_states.pt")
    elif kind == "pipeline_parallel":
        shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "layer_01-model_states.pt")
    elif kind == "universal":
        (tag_dir / "zero" / "embed.weight").mkdir(parents=True)
    else:
        (directory / "latest").rename(directory / "latest_universal")
    with pytest.raises(ConfigError, match=message) as caught:
        import_deepspeed_checkpoint(directory)
    assert "fix:" in str(caught.value)


def test_stage0_is_a_plain_state_dict(runs: dict[str, tuple[Path, DeepSpeedRun]]) -> None:
    with pytest.raises(ConfigError, match="ZeRO stage 0 checkpoint: its 'module' is already the full model"):
        import_deepspeed_checkpoint(runs["zero0"][0])


def test_dynamic_loss_scaler_and_scheduler_are_reported(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                        tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    tag_dir = copy_of(runs, "zero2", tmp_path) / "global_step4"
    for path in sorted(tag_dir.glob("*_optim_states.pt")):  # our own files: trusted, plain load is fine here
        saved = torch.load(path, weights_only=False)
        saved["optimizer_state_dict"]["loss_scaler"] = DynamicLossScaler(2.0**12, 1000, 1, 2, False)
        saved["optimizer_state_dict"]["dynamic_loss_scale"] = True
        torch.save(saved, path)
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(model_file, weights_only=False)
    torch.save(model | {"lr_scheduler": {"last_epoch": SAVED_AT, "_last_lr": [LR]}}, model_file)
    state, report = import_deepspeed_checkpoint(tag_dir)
    assert state.metadata["loss_scale"] == 2.0**12 and state.metadata["dynamic_loss_scale"] is True
    assert report.find("loss_scaler").status is Status.APPROXIMATED  # type: ignore[union-attr]
    assert report.find("lr_scheduler").status is Status.EXACT  # type: ignore[union-attr]
    assert state.scheduler == {"last_epoch": SAVED_AT, "_last_lr": [LR]}  # a torch scheduler's state, kept


def test_reads_without_importing_deepspeed(runs: dict[str, tuple[Path, DeepSpeedRun]]) -> None:
    code = ("import sys; from zerobridge.checkpoint.deepspeed_import import import_deepspeed_checkpoint; "
            f"state, _ = import_deepspeed_checkpoint({str(runs['zero3'][0])!r}); "
            "assert len(state.optimizer) == 17, len(state.optimizer); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- import, then go on natively

@pytest.fixture(scope="module")
def native_cluster() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=120) as cluster:
        yield cluster


@pytest.mark.parametrize(("name", "stage"), [("zero1", 3), ("zero2", 1), ("zero3", 0)])
def test_imported_checkpoint_continues_training_identically(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                            native_cluster: Cluster, tmp_path: Path, name: str,
                                                            stage: int, capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed trained on after saving; the import, resumed by the native engine at
    another stage, must take the same steps: losses and final weights equal."""
    from zerobridge.cli import main

    directory, run = runs[name]
    assert main(["checkpoint", "import-deepspeed", str(directory), "-o", str(tmp_path / "imported")]) == 0
    out = capsys.readouterr().out
    assert f"stage {CASES[name]['stage']} checkpoint global_step{SAVED_AT}" in out and "wrote" in out
    results = native_cluster.run("zerobridge.testing.resume:resume_native", path=str(tmp_path / "imported"),
                                 start=SAVED_AT, stop=STEPS, stage=stage)
    got, want = results[0]["losses"], run.losses[SAVED_AT:]  # type: ignore[index]
    assert len(got) == len(want) == STEPS - SAVED_AT
    for step, (a, b) in enumerate(zip(got, want), start=SAVED_AT):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: native {a} vs DeepSpeed {b}"
    assert results[0]["metadata"]["source"] == "deepspeed"  # type: ignore[index]
    full = results[0]["full"]  # type: ignore[index]
    for fqn, value in run.final_params.items():
        if fqn not in UNUSED:  # DeepSpeed decays the never-used weight; the engine leaves it (grad None)
            torch.testing.assert_close(full[fqn], value, rtol=0, atol=1e-5, msg=fqn)


# ---------------------------------------------------------------------------- the schedule and client state

def resume_scheduled(*, path: str, stage: int) -> dict[str, Any]:
    """On every rank: the native engine and the torch equivalent of the JSON's WarmupLR, loaded from an
    imported checkpoint and trained on; the lr each step ran with."""
    import zerobridge
    from zerobridge.runtime.lr_schedules import build_scheduler
    from zerobridge.testing.resume import clip_native, native, train_steps

    model, optimizer = native(7, stage)
    scheduler = build_scheduler(WARMUP, optimizer)
    loaded = zerobridge.load_checkpoint(path, model, optimizer, scheduler=scheduler)
    position = scheduler.state_dict()["last_batch_iteration"]
    losses, lrs = [], []
    for step in range(SAVED_AT, STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        losses += train_steps(model, optimizer, range(step, step + 1), clip_native)
        scheduler.step()
    return {"loaded": loaded, "position": position, "losses": losses, "lrs": lrs}


def load_natively(*, path: str) -> None:
    """On every rank: ``load_checkpoint`` straight on a DeepSpeed directory."""
    import zerobridge
    from zerobridge.testing.resume import native

    model, optimizer = native(7, 1)
    zerobridge.load_checkpoint(path, model, optimizer)


def test_the_scheduler_and_client_state_are_imported(runs: dict[str, tuple[Path, DeepSpeedRun]]) -> None:
    state, report = import_deepspeed_checkpoint(runs["scheduled"][0])
    assert state.scheduler == {"last_batch_iteration": SAVED_AT - 1}  # DeepSpeed's schedules count from -1
    assert state.client_state == SCHEDULED["client_state"]
    assert state.metadata["deepspeed"] == {"global_steps": SAVED_AT, "global_samples": 8 * SAVED_AT,
                                           "skipped_steps": 0}
    kept = report.find("lr_scheduler")
    assert kept is not None and kept.status is Status.EXACT and "last_batch_iteration 3" in kept.note
    assert report.with_status(Status.NOT_EXPRESSIBLE) == []


def test_an_imported_schedule_continues_with_deepspeeds_lrs(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                             native_cluster: Cluster, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed trained on with its WarmupLR after saving; the import, resumed natively at stage 3 with the
    torch equivalent, takes the same steps with the same lrs and gets the client state back."""
    from zerobridge.cli import main

    directory, run = runs["scheduled"]
    assert main(["checkpoint", "import-deepspeed", str(directory), str(tmp_path / "imported")]) == 0  # SRC DST
    assert "LR scheduler state, client_state ['best', 'epoch', 'seen']" in capsys.readouterr().out
    results = native_cluster.run(f"{ME}:resume_scheduled", path=str(tmp_path / "imported"), stage=3)
    want = run.losses[SAVED_AT:]
    for result in results:
        assert isinstance(result, dict)
        assert result["loaded"]["client_state"] == SCHEDULED["client_state"]
        assert result["loaded"]["deepspeed"]["global_steps"] == SAVED_AT
        assert result["position"] == SAVED_AT - 1
        # DeepSpeed's linear warmup: step k runs with the lr of iteration k - 1, i.e. LR * (k - 1) / 6
        assert result["lrs"] == pytest.approx([LR * (k - 1) / 6 for k in range(SAVED_AT, STEPS)], rel=1e-12)
        for step, (a, b) in enumerate(zip(result["losses"], want, strict=True), start=SAVED_AT):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: native {a} vs DeepSpeed {b}"


def test_deepspeeds_own_schedule_takes_a_torch_state() -> None:
    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    schedule = WarmupLR(optimizer, warmup_max_lr=0.1, warmup_num_steps=6, warmup_type="linear")
    restore_scheduler(schedule, {"last_epoch": SAVED_AT, "_step_count": SAVED_AT + 1, "base_lrs": [0.1]})
    assert schedule.last_batch_iteration == SAVED_AT - 1  # the same number of steps taken
    restore_scheduler(schedule, {"last_batch_iteration": 6})
    assert schedule.last_batch_iteration == 6


def test_import_takes_one_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.cli import main

    assert main(["checkpoint", "import-deepspeed", str(tmp_path)]) == 2
    assert f"fix: zerobridge checkpoint import-deepspeed {tmp_path} OUTPUT" in capsys.readouterr().err
    assert main(["checkpoint", "import-deepspeed", str(tmp_path), "a", "-o", "b"]) == 2
    assert "got two outputs, a and -o b" in capsys.readouterr().err


def _command(error: str) -> list[str]:
    found = [line for line in error.splitlines() if "`zerobridge checkpoint import-deepspeed " in line]
    assert found, error
    return shlex.split(found[0].split("`")[1])


def test_loading_a_deepspeed_directory_names_the_import_command(runs: dict[str, tuple[Path, DeepSpeedRun]],
                                                                native_cluster: Cluster, tmp_path: Path) -> None:
    from zerobridge.checkpoint.reader import open_checkpoint
    from zerobridge.cli import main

    directory = copy_of(runs, "scheduled", tmp_path)
    with pytest.raises(RankError) as caught:
        native_cluster.run(f"{ME}:load_natively", path=str(directory))
    text = caught.value.tracebacks[0]
    assert f"CheckpointError: {directory}: is a DeepSpeed checkpoint" in text
    command = _command(text)
    assert command == ["zerobridge", "checkpoint", "import-deepspeed", str(directory), f"{directory}-zerobridge"]
    assert main(command[1:]) == 0  # the command works as given
    results = native_cluster.run("zerobridge.testing.resume:resume_native", path=f"{directory}-zerobridge",
                                 start=SAVED_AT, stop=SAVED_AT + 1, stage=1)
    assert results[0]["metadata"]["client_state"] == SCHEDULED["client_state"]  # type: ignore[index]

    with pytest.raises(CheckpointError) as tag_dir:  # one tag directory
        open_checkpoint(directory / "global_step4")
    assert _command(str(tag_dir.value))[3:] == [str(directory / "global_step4"),
                                                f"{directory / 'global_step4'}-zerobridge"]
    (directory / "latest").unlink()
    with pytest.raises(CheckpointError) as no_latest:  # tags but no latest: the newest tag
        open_checkpoint(directory)
    assert _command(str(no_latest.value))[3:] == [str(directory), f"{directory}-zerobridge", "--tag", "global_step4"]
