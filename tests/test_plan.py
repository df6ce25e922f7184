"""``zerobridge plan``: fake-tensor runs that equal real ones, formulas, real HF configs, outputs, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from zerobridge.cli import main
from zerobridge.errors import ConfigError
from zerobridge.explain import explain
from zerobridge.harness.cluster import Cluster
from zerobridge.planning import plan
from zerobridge.planning.fake_run import Run, run_once
from zerobridge.planning.measure import SHALLOW, extend
from zerobridge.planning.models import resolve_model
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage

MOE = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
       "vocab_size": 512, "max_position_embeddings": 256, "architectures": ["MixtralForCausalLM"]}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def cluster() -> Any:
    with Cluster(2, timeout_s=600) as c:
        yield c


@pytest.fixture(scope="module")
def gpt_plan() -> Any:
    return plan("tiny-gpt:20m", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=128, precision="fp32",
                workers=1)


# ----------------------------------------------------------------- the fake run is the real run


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3+ac", "zero2-offload", "zero3-offload"])
def test_predicted_peaks_equal_a_real_gloo_run(cluster: Any, gpt_plan: Any, name: str) -> None:
    """Every phase's peak of the fake run equals the real run's within 10% (measured: exactly), and
    so do the bytes each collective moves."""
    row = gpt_plan.row(name)
    real = cluster.run("zerobridge.testing.plan_measure:measure", model="tiny-gpt:20m",
                       spec=row.spec.model_dump(mode="json"), micro_batch=2, seq_len=128)
    for rank in real:
        for phase in ("forward", "backward", "step"):
            assert row.peaks[phase] == pytest.approx(rank["peaks"][phase], rel=0.10), phase
        assert rank["comm_bytes"] == row.comm_by_kind
    assert max(row.peaks[p] for p in ("forward", "backward", "step")) == pytest.approx(
        max(real[0]["peaks"][p] for p in ("forward", "backward", "step")), rel=1e-6)


def test_bf16_llama_checkpointed_equals_a_real_run(cluster: Any) -> None:
    result = plan("tiny-llama", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=64, workers=1,
                  strategies=["zero3"], only_own=True)
    for row in result.rows:
        real = cluster.run("zerobridge.testing.plan_measure:measure", model="tiny-llama",
                           spec=row.spec.model_dump(mode="json"), micro_batch=2, seq_len=64)[0]
        for phase in ("forward", "backward", "step"):
            assert row.peaks[phase] == pytest.approx(real["peaks"][phase], rel=0.10), (row.name, phase)


# ----------------------------------------------------------------- what the figures mean


def test_model_states_are_explains_formula_and_the_engine_agrees(gpt_plan: Any) -> None:
    params = resolve_model("tiny-gpt:20m").params
    for row in gpt_plan.rows:
        e = explain(row.spec, params=params, world_size=2, local_world_size=2)
        assert row.model_state_bytes == e.model_state_bytes and row.explanation.formula == e.formula
    # the engine's own accounting of what it holds at rest, within its per-unit padding of the formula
    source = resolve_model("tiny-gpt:20m")
    measured = run_once(source, gpt_plan.row("zero3").spec, Run(world_size=2, nodes=1, micro_batch=2, seq_len=128))
    held = sum(measured.model_states.values())
    assert held == pytest.approx(gpt_plan.row("zero3").model_state_bytes, rel=0.01)


def test_zero_paper_figure() -> None:
    """ZeRO's 7.5B model on 64 GPUs: 120 GB of model states per GPU at stage 0, 1.9 GB at stage 3."""
    stage0 = explain(spec_for_stage(0), params=7_500_000_000, world_size=64).model_state_bytes
    stage3 = explain(spec_for_stage(3), params=7_500_000_000, world_size=64).model_state_bytes
    assert stage0 == pytest.approx(120e9, rel=0.02) and stage3 == pytest.approx(1.9e9, rel=0.02)


def test_ranking_and_checkpointing(gpt_plan: Any) -> None:
    rows = {r.name: r for r in gpt_plan.rows}
    assert rows["zero3"].device_peak < rows["zero2"].device_peak < rows["zero0"].device_peak
    assert rows["zero3+ac"].peaks["backward"] < rows["zero3"].peaks["backward"]
    assert rows["zero3-offload"].host_bytes > 0 and rows["zero3-offload"].device_peak < rows["zero3"].device_peak
    best = gpt_plan.recommended
    fitting = [r for r in gpt_plan.rows if r.fits]
    assert best.fits and best.comm_bytes == min(r.comm_bytes for r in fitting)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deep_model_is_extended_from_two_depths(stage: int) -> None:
    """The 100M GPT (12 blocks) from 5 and 6 blocks against its whole depth: traffic and tiers exact,
    each phase's peak within 2% (docs/plan.md has the errors at 8B and 70B)."""
    source = resolve_model("tiny-gpt:100m")
    run = Run(world_size=4, nodes=1, micro_batch=1, seq_len=128)
    spec = spec_for_stage(stage, source.build(2))
    low, high, whole = (run_once(source, spec, run, layers=d) for d in (*SHALLOW, source.layers))
    assert SHALLOW[1] < (source.layers or 0)
    extended = extend(low, high, SHALLOW, source.layers or 0)
    for kind, moved in whole.comm_bytes.items():
        assert extended.comm_bytes[kind] == pytest.approx(moved, rel=1e-6, abs=16)
    assert extended.tiers == pytest.approx(whole.tiers, rel=1e-6, abs=16)
    for phase in ("forward", "backward", "step"):
        assert extended.peaks[phase] == pytest.approx(whole.peaks[phase], rel=0.02)
    assert not dist.is_initialized()  # the fake group is gone with the run


@pytest.mark.parametrize(("stage", "precision"), [(1, "bf16"), (2, "fp32"), (3, "fp32")])
def test_a_fake_run_leaves_out_repeated_optimizer_calls_and_its_figures_stay(
        stage: int, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NativeStepper.skip_repeats`` (plans only): the largest range of a parameter stepped in ranges
    stands for the others, and once the state exists a tile no larger than one already stepped is left
    out. Every figure is the one stepping all of them gives; the optimizer is called less often."""
    import zerobridge.engine.step as step_module

    calls = [0]
    raw_step = step_module.raw_step

    def counted(optimizer: Any) -> Any:
        calls[0] += 1
        return raw_step(optimizer)

    monkeypatch.setattr(step_module, "raw_step", counted)
    source = resolve_model("tiny-llama")
    run = Run(world_size=2, nodes=1, micro_batch=2, seq_len=64)
    spec = StrategySpec.model_validate(spec_for_stage(stage, source.build(1)).model_dump()
                                       | {"precision": {"param_dtype": precision}})
    measured = {}
    for skip in (False, True):
        calls[0] = 0
        measured[skip] = (run_once(source, spec, run, skip_repeats=skip), calls[0])
    (every, every_calls), (skipped, skipped_calls) = measured[False], measured[True]
    assert skipped.peaks == every.peaks and skipped.tiers == every.tiers
    assert skipped.model_states == every.model_states and skipped.comm_bytes == every.comm_bytes
    assert skipped_calls < every_calls / 2


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_fake_runs_step_one_parameter_of_each_kind_and_the_figures_stay(
        offload: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second step on, the FSDP2 fake run's optimizer steps one parameter of each shape: the
    peaks, tiers (offloaded state on the host) and model states are those of stepping every one."""
    import zerobridge.planning.fsdp_fake_run as fsdp_fake_run

    source = resolve_model("tiny-llama")
    run = Run(world_size=2, nodes=1, micro_batch=2, seq_len=64)
    base = spec_for_stage(3, source.build(1)).model_dump()
    on_host = {"offload": {"optimizer": {"device": "cpu"}, "parameters": {"device": "cpu"}}}
    spec = StrategySpec.model_validate(base | (on_host if offload else {}))
    stepped: list[int] = []
    one_of_each = fsdp_fake_run._one_of_each_kind

    def counted(optimizer: Any) -> None:
        before = sum(len(g["params"]) for g in optimizer.param_groups)
        one_of_each(optimizer)
        stepped.append(before - sum(len(g["params"]) for g in optimizer.param_groups))

    monkeypatch.setattr(fsdp_fake_run, "_one_of_each_kind", counted)
    fewer, _ = fsdp_fake_run.run_fsdp(source, spec, run)
    monkeypatch.setattr(fsdp_fake_run, "_one_of_each_kind", lambda optimizer: None)
    every, _ = fsdp_fake_run.run_fsdp(source, spec, run)
    assert stepped and stepped[0] > 10  # parameters left out of the second step
    assert {k: v for k, v in fewer.peaks.items() if k != "setup"} == \
           {k: v for k, v in every.peaks.items() if k != "setup"}
    assert fewer.tiers == every.tiers and fewer.model_states == every.model_states
    assert fewer.tiers["host" if offload else "device"] > 0


@pytest.mark.parametrize("flavor", ["native", "fsdp2"])
def test_the_counting_fake_mode_counts_what_a_tracker_stacked_above_it_counts(
        flavor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CountingFakeMode`` counts inside the fake mode what a ``StorageTracker`` stacked above a
    ``FakeTensorMode`` counts (the way real runs are counted: one mode above every operation). FSDP2's
    DTensor operations are counted as the DTensor, never the local operations inside them: counted there,
    FSDP2's step peaks tripled. Its mesh table is made outside the fake mode and adopted after setup."""
    from collections.abc import Iterator
    from contextlib import contextmanager

    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    import zerobridge.planning.fsdp_fake_run as fsdp_fake_run
    from zerobridge.planning import fake_run
    from zerobridge.planning.flavors import measure_flavor
    from zerobridge.planning.tracker import StorageTracker

    class Stacked(StorageTracker):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.prim.device.default and isinstance(args[0], FakeTensor):
                return args[0].fake_device
            return super().__torch_dispatch__(func, types, args, kwargs)

    @contextmanager
    def stacked() -> Iterator[StorageTracker]:
        with FakeTensorMode(allow_non_fake_inputs=True), Stacked() as tracker:
            yield tracker

    source = resolve_model("tiny-llama")
    run = Run(world_size=2, nodes=1, micro_batch=2, seq_len=64)
    spec = StrategySpec.model_validate(spec_for_stage(3, source.build(1)).model_dump()
                                       | {"precision": {"param_dtype": "bf16"}})
    counted = measure_flavor(source, spec, run, True, flavor).measured
    for module in (fake_run, fsdp_fake_run):
        monkeypatch.setattr(module, "fake_tracking", stacked)
    above = measure_flavor(source, spec, run, True, flavor).measured
    assert counted is not None and above is not None
    assert {k: v for k, v in counted.peaks.items() if k != "setup"} == \
           {k: v for k, v in above.peaks.items() if k != "setup"}
    assert counted.tiers == above.tiers and counted.comm_bytes == above.comm_bytes
    if flavor == "native":
        assert counted.peaks["setup"] == above.peaks["setup"]


# ----------------------------------------------------------------- real configs


def test_checkpointed_hf_layers_keep_no_kv_cache_through_backward() -> None:
    """A Hugging Face model in training mode hands each layer its KV cache; under activation
    checkpointing every layer's keys and values would stay in it through backward (and be appended
    again by the recomputation): the backward peak grew faster with depth than the forward peak. The
    cache is dropped from checkpointed units, with a warning, so both grow alike (measured: 3.16 MB
    per layer each; with the cache, 4.21 MB in backward against 3.43 MB in forward)."""
    source = resolve_model("tiny-llama")
    peaks = {}
    for depth in (4, 8):
        model = source.build(depth)
        ac = spec_for_stage(3, model).model_dump(mode="json")
        ac["checkpoint"]["activation_checkpointing"] = True
        with pytest.warns(UserWarning, match="activation checkpointing: .*dropped"):
            peaks[depth] = run_once(source, StrategySpec.model_validate(ac),
                                    Run(world_size=4, nodes=1, micro_batch=2, seq_len=128), layers=depth).peaks
    per_layer = {phase: (peaks[8][phase] - peaks[4][phase]) / 4 for phase in ("forward", "backward")}
    assert per_layer["backward"] == per_layer["forward"], per_layer


def test_meta_built_hf_llama_and_moe(tmp_path: Path) -> None:
    config = tmp_path / "moe"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(MOE))
    for model in ("tiny-llama", str(config)):
        result = plan(model, world_size=4, nodes=2, device_memory="2GiB", micro_batch=1, seq_len=64, workers=2)
        names = {r.name for r in result.rows}
        assert {"zero3-hpz", "zero3-hybrid", "zero2-hybrid+ac"} <= names
        assert result.recommended.fits
        assert result.row("zero3").device_peak < result.row("zero0").device_peak


def test_cli_writes_the_recommendation_for_deepspeed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from deepspeed.runtime import config as deepspeed_config

    out_file = tmp_path / "ds.json"
    code, out, err = cli(capsys, "plan", "tiny-gpt", "--world-size", "2", "--device-memory", "64MiB",
                         "--micro-batch", "2", "--seq-len", "16", "--to", "deepspeed", "-o", str(out_file))
    # stages 0-2 move the same bytes here; zero2 holds the least without offload or recomputation
    # --to deepspeed plans on DeepSpeed (its buffers modelled) and says so
    assert code == 0 and "recommended for deepspeed: zero2" in out and "wrote zero2 as deepspeed" in err
    ds = json.loads(out_file.read_text())
    checked = deepspeed_config.DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    assert checked.zero_optimization_stage == 2 and checked.train_micro_batch_size_per_gpu == 2
    # buckets sized from the model, never DeepSpeed's 5e8 defaults, which it would preallocate twice with
    # overlap_comm (issue 31): the all-gather bucket to the largest wrap unit (here the root: the whole
    # model), the reduce bucket to hidden_size^2 (n_embd 64), as Trainer fills "auto"
    params = resolve_model("tiny-gpt").params
    assert checked.zero_config.allgather_bucket_size == params and checked.zero_config.reduce_bucket_size == 64 * 64
    assert "warning: communication.reduce_bucket" in err and "2 x reduce_bucket_size elements" in err
    code, out, _ = cli(capsys, "plan", "tiny-gpt", "--world-size", "2", "--device-memory", "64MiB",
                       "--micro-batch", "2", "--seq-len", "16", "--json")
    data = json.loads(out)
    assert code == 0 and data["recommended"] == "zero2" and len(data["candidates"]) == 14


def test_cli_nothing_fits_says_what_would(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "plan", "tiny-gpt:20m", "--world-size", "2", "--device-memory", "40MiB",
                       "--micro-batch", "2", "--seq-len", "64", "--precision", "fp32")
    # activations, not model states, are what does not fit here: more ranks would not help
    assert code == 1 and "nothing fits in" in err and "What would: a smaller --micro-batch" in err
    assert "ranks (" not in err


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(("argv", "expected"), [
    (["tiny-gpt", "--world-size", "2", "--device-memory", "80 gigs"], "'80 gigs' is not a memory size"),
    (["tiny-gpt", "--world-size", "6", "--nodes", "4", "--device-memory", "1GiB"], "not a multiple of --nodes"),
    (["tiny-gpt:7b", "--world-size", "2", "--device-memory", "1GiB"], "unknown preset"),
    (["tiny-gpt", "--world-size", "2", "--device-memory", "1GiB", "--seq-len", "64"], "longer than"),
    (["tiny-gpt", "--world-size", "2", "--device-memory", "1GiB", "-o", "x.json"], "no --to is given"),
])
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    code, _, err = cli(capsys, "plan", *argv)
    assert code == 2 and expected in err and "Traceback" not in err


def test_unknown_architecture_names_the_class_it_tried(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    code, _, err = cli(capsys, "plan", str(unknown), "--world-size", "2", "--device-memory", "1GiB")
    assert code == 2 and "transformers.AutoConfig does not know model_type 'no-such-model'" in err
    vision = tmp_path / "vit.json"
    vision.write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    code, _, err = cli(capsys, "plan", str(vision), "--world-size", "2", "--device-memory", "1GiB")
    assert code == 2 and "AutoModelForCausalLM has no class for model_type 'vit'" in err
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ConfigError, match="is not JSON") as raised:
        resolve_model(str(broken))
    assert raised.value.line == 2
