"""``zerobridge compare``: planning, judging, reports, and real comparisons across backends.

The unit tests build ``RunOutcome`` values by hand and need no process group.
The distributed tests run the real command (each run in its own 2-process
gloo group, as ``zerobridge compare`` always does) on a few stages and
backends, and check the built-in model's losses against a single process.

    .venv/bin/python -m pytest -q tests/test_compare.py
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from zerobridge.cli import main
from zerobridge.compare import Comparison, Planned, RunOutcome, Skipped, plan
from zerobridge.compare.report import relative
from zerobridge.errors import ConfigError
from zerobridge.spec.presets import spec_for_stage

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def outcome(name: str, losses: list[float], norms: list[float] | None = None, *, error: str | None = None,
            stage: int = 3, approximations: tuple[str, ...] = (), formula_stage: int | None = None) -> RunOutcome:
    backend, _, label = name.partition("/")
    planned = Planned(name, backend, label, stage, spec_for_stage(stage), True, approximations, formula_stage)
    return RunOutcome(planned=planned, world_size=2, losses=losses, grad_norms=norms or [1.0] * len(losses),
                      step_times=[0.05, 0.01, 0.02, 0.03], comm_bytes={"all_gather": 2048.0, "reduce_scatter": 1024.0},
                      model_state_bytes={"params": 100, "grads": 100, "optimizer": 200},
                      formula_model_state_bytes=400, peak_rss_bytes=2**20, error=error)


def comparison(*runs: RunOutcome, tolerance: float = 1e-5) -> Comparison:
    return Comparison(runs=list(runs), skipped=[Skipped("fsdp", 1, "stage1", "ZeRO-1 has no FSDP form")],
                      tolerance=tolerance, norm_tolerance=10 * tolerance, model="tiny-gpt", params=1000, world_size=2,
                      steps=3)


# --- judging --------------------------------------------------------------------------------------------


def test_relative_deviation() -> None:
    assert relative(2.0, 2.0) == 0.0
    assert relative(2.5, 2.0) == pytest.approx(0.25)
    assert relative(0.5, 0.0) == 0.5
    assert relative(math.nan, 1.0) == math.inf and relative(1.0, math.inf) == math.inf


def test_runs_within_tolerance_agree() -> None:
    c = comparison(outcome("native/stage3", [3.0, 2.0, 1.0]), outcome("fsdp/stage3", [3.0, 2.0 * (1 + 5e-6), 1.0]))
    assert c.ok and c.divergences == [] and c.max_deviation() == pytest.approx(5e-6)
    assert c.verdict().startswith("OK: 2 run(s) agree with native/stage3 over 3 steps: max loss deviation 5.00e-06")


def test_first_divergent_step_and_metric_are_named() -> None:
    c = comparison(outcome("native/stage3", [3.0, 2.0, 1.0]),
                   outcome("deepspeed/stage3", [3.0, 2.0, 1.0], [1.0, 1.0 + 1e-3, 1.0]),
                   outcome("fsdp/stage2", [3.0, 2.0, 1.0], [1.0, 1.0 + 5e-5, 1.0]),  # within the norm's bound
                   outcome("fsdp/stage3", [3.0, 2.1, 1.0]))
    assert not c.ok
    first, second = c.divergences
    assert (first.run, first.step, first.metric) == ("deepspeed/stage3", 1, "grad_norm")
    assert (second.run, second.step, second.metric) == ("fsdp/stage3", 1, "loss")
    assert "fsdp/stage3 diverges from native/stage3 at step 1: loss 2.1 vs 2" in c.verdict()


def test_non_finite_loss_diverges() -> None:
    c = comparison(outcome("native/stage3", [3.0, 2.0]), outcome("fsdp/stage3", [3.0, math.nan]))
    assert [(d.run, d.step) for d in c.divergences] == [("fsdp/stage3", 1)]
    assert c.to_json()["runs"][1]["losses"] == [3.0, None]  # JSON has no NaN
    json.dumps(c.to_json(), allow_nan=False)


def test_failed_run_fails_the_comparison_and_the_next_run_is_reference() -> None:
    c = comparison(outcome("native/stage3", [], error="rank 1: RuntimeError: boom"),
                   outcome("fsdp/stage3", [3.0, 2.0]), outcome("deepspeed/stage3", [3.0, 2.0]))
    assert not c.ok and c.reference is not None and c.reference.planned.name == "fsdp/stage3"
    assert c.status == "failed" and "runs disagree" not in c.verdict()  # a run that never ran disagrees with nothing
    assert c.verdict().splitlines() == ["zerobridge compare: 1 run(s) failed (never started or crashed); the 2 that "
                                        "finished agree", "failed native/stage3: rank 1: RuntimeError: boom"]
    assert c.to_json()["failed"] == [{"run": "native/stage3", "error": "rank 1: RuntimeError: boom"}]
    c.runs.append(outcome("fsdp/stage2", [3.0, 2.5]))
    assert c.status == "disagree" and c.verdict().startswith("zerobridge compare: runs disagree")


def test_a_divergence_between_precisions_says_so() -> None:
    bf16 = outcome("native/bf16", [3.0, 2.1])
    object.__setattr__(bf16.planned, "spec", spec_for_stage(3).model_copy(update={
        "precision": spec_for_stage(3).precision.model_copy(update={"param_dtype": "bf16"})}))
    c = comparison(outcome("native/stage3", [3.0, 2.0]), bf16)
    assert c.status == "disagree" and "the runs compute in bf16 and fp32" in c.verdict()
    assert "compute in" not in comparison(outcome("native/stage3", [3.0, 2.0]),
                                          outcome("fsdp/stage3", [3.0, 2.1])).verdict()


def test_every_status_has_its_own_exit_code() -> None:
    from zerobridge.compare.cli import EXIT_CODES

    assert EXIT_CODES == {"ok": 0, "disagree": 1, "failed": 3}  # 2: bad input, before any run
    none_ran = comparison(outcome("native/stage3", [], error="rank 0: start-up failed"))
    assert none_ran.status == "failed" and "no run finished" in none_ran.verdict()


def test_json_has_the_documented_fields() -> None:
    data = comparison(outcome("native/stage3", [3.0, 2.0, 1.0]), outcome("fsdp/stage3", [3.0, 2.0, 1.0])).to_json()
    assert {"ok", "max_loss_deviation", "runs", "skipped"} <= set(data)
    run = data["runs"][1]
    assert {"name", "backend", "stage", "world_size", "losses", "grad_norms", "model_state_bytes", "peak_rss_bytes",
            "comm_bytes", "step_time_s"} <= set(run)
    assert set(run["model_state_bytes"]) == {"params", "grads", "optimizer"}
    assert run["step_time_s"] == pytest.approx(0.02)  # the median after the first (warm-up) step, not 0.025
    assert data["skipped"] == [{"backend": "fsdp", "stage": 1, "label": "stage1", "reason": "ZeRO-1 has no FSDP form"}]


def test_the_independent_memory_measure_is_shown_beside_the_engines_and_a_mismatch_marked() -> None:
    agree, differ = outcome("native/stage3", [3.0, 2.0, 1.0]), outcome("fsdp/stage3", [3.0, 2.0, 1.0])
    agree.live_bytes = {"params": 150, "grads": 50, "optimizer": 200, "other": 0}  # the engine said 100/100/200
    differ.live_bytes = {"params": 100, "grads": 50, "optimizer": 150, "other": 0}
    text = comparison(agree, differ).render()
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("native/", "fsdp/"))}
    assert "≠" not in rows["native/stage3"] and "≠ 25%" in rows["fsdp/stage3"]
    runs = comparison(agree, differ).to_json()["runs"]
    assert [r["live_mismatch"] for r in runs] == [0.0, 0.25] and runs[0]["live_bytes"]["params"] == 150


def test_live_storages_count_what_the_process_holds_once_however_many_views() -> None:
    import torch

    from zerobridge.compare.memory import live_by_role

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = sum(live_by_role(model, optimizer).values())
    # DeepSpeed's stage-3 reduce bucket on the CPU: 5e8 elements allocated whatever the model, written only
    # as far as the gradients it reduces; seen through many views, as flat buffers are.
    bucket = torch.empty(2**26)
    views = [bucket[i * 1024:(i + 1) * 1024] for i in range(64)]
    views[0].fill_(1.0)
    held = live_by_role(model, optimizer)
    grown = sum(held.values()) - before
    assert 4096 <= grown < 4 * 2**20, f"{grown} bytes for one written page of a 256 MiB storage (views: {len(views)})"
    assert held["params"] == held["grads"] == 80 and held["optimizer"] >= 160
    bucket[:64 * 1024].fill_(1.0)  # written as far as the last view: 256 KiB, counted once
    assert 64 * 4096 <= sum(live_by_role(model, optimizer).values()) - before < 4 * 2**20


def test_terminal_and_markdown_tables() -> None:
    c = comparison(outcome("native/stage3", [3.0, 2.0, 1.0]), outcome("fsdp/stage3", [3.0, 2.0, 1.0]))
    text = c.render()
    assert "native/stage3" in text and "AG 2.05 KB RS 1.02 KB" in text and "skipped fsdp/stage1" in text
    md = c.markdown()
    assert md.startswith("## zerobridge compare ✅") and "| `native/stage3` | `fsdp/stage3` |" in md
    assert "| fsdp/stage3 | 3 | 1.000000 |" in md


def approximated_pair() -> Comparison:
    return comparison(outcome("native/stage1", [3.0, 2.0, 1.0], stage=1),
                      outcome("fsdp/stage1", [3.0, 2.0, 1.0], stage=1, approximations=("sharding",), formula_stage=2))


def test_an_approximated_run_is_marked_in_terminal_json_and_markdown() -> None:
    c = approximated_pair()
    assert c.ok  # judged like the others
    text, md, data = c.render(), c.markdown(), c.to_json()
    assert "fsdp/stage1 ~" in text and "1.000 (ZeRO-2)" in text
    assert "~ fsdp/stage1 is approximated (sharding)" in text and "memory against the ZeRO-2 formula" in text
    assert data["approximated"] == ["fsdp/stage1"]
    assert data["runs"][1]["approximations"] == ["sharding"] and data["runs"][1]["formula_stage"] == 2
    assert data["runs"][0]["formula_stage"] is None
    assert "| fsdp/stage1 ~ | 1 |" in md and "- fsdp/stage1 is approximated (sharding)" in md


def test_plot_legend_marks_approximated_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from zerobridge.compare.plot import write_plot

    drawn: list[object] = []
    monkeypatch.setattr(plt, "close", drawn.append)
    write_plot(approximated_pair(), tmp_path / "c.png")
    curves, memory, _ = drawn[0].axes  # type: ignore[attr-defined]
    assert [t.get_text() for t in curves.get_legend().get_texts()] == ["native/stage1", "fsdp/stage1 (approximated)"]
    assert "ZeRO formula (~ runs: ZeRO-2)" in [t.get_text() for t in memory.get_legend().get_texts()]
    assert [t.get_text() for t in memory.get_xticklabels()] == ["native/stage1", "fsdp/stage1 ~"]


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from zerobridge.compare.plot import write_plot

    target = write_plot(comparison(outcome("native/stage3", [3.0, 2.0, 1.0]), outcome("fsdp/stage3", [3.0, 2.0, 1.5])),
                        tmp_path / "out" / "c.png")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in target.parent.iterdir()] == ["c.png"]  # no temporary file left


def test_plot_without_matplotlib_is_bad_input(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["compare", "--stages", "0", "--plot", str(tmp_path / "c.png")]) == 2
    assert "pip install 'zerobridge[plot]'" in capsys.readouterr().err


# --- planning and bad input -----------------------------------------------------------------------------


def test_plan_runs_the_closest_form_of_what_a_backend_cannot_express() -> None:
    p = plan(stages=[0, 1, 2, 3], backends=["native", "fsdp", "deepspeed"], nproc=2, steps=2)
    assert [r.name for r in p.runs] == ["native/stage0", "fsdp/stage0", "deepspeed/stage0", "native/stage1",
                                        "fsdp/stage1", "deepspeed/stage1", "native/stage2", "fsdp/stage2",
                                        "deepspeed/stage2", "native/stage3", "fsdp/stage3", "deepspeed/stage3"]
    assert p.comparison.skipped == []
    approximated = {r.name: (r.approximations, r.formula_stage) for r in p.runs if r.approximations}
    assert approximated == {"fsdp/stage1": (("sharding",), 2), "fsdp/stage2": (("sharding",), 2)}
    assert p.comparison.params == 118_400 and p.optimizer == "adam"


def test_exact_only_skips_what_a_backend_cannot_express() -> None:
    p = plan(stages=[0, 1, 2, 3], backends=["native", "fsdp", "deepspeed"], nproc=2, steps=2, exact_only=True)
    assert "fsdp/stage1" not in [r.name for r in p.runs] and all(not r.approximations for r in p.runs)
    assert [(s.backend, s.stage) for s in p.comparison.skipped] == [("fsdp", 1), ("fsdp", 2)]
    assert "ZeRO-1 has no FSDP form" in p.comparison.skipped[0].reason


def test_compile_plans_every_pair_compiled() -> None:
    from zerobridge.compare.runner import _choice

    p = plan(stages=[0, 3], backends=["native", "deepspeed"], nproc=2, steps=2, compile=True)
    assert all(r.spec.compile.enabled for r in p.runs)
    assert [_choice(r) for r in p.runs if r.by_stage][0] == {"stage": 0, "compile": True}
    assert {r.name: r.approximations for r in p.runs if r.approximations} == {"deepspeed/stage3": ("compile.scope",)}
    assert p.comparison.compiled and p.comparison.to_json()["compiled"] is True
    assert ", compiled" in p.comparison.render().splitlines()[0]
    eager = plan(stages=[0], backends=["native"], nproc=2, steps=2)
    assert _choice(eager.runs[0]) == {"stage": 0} and not eager.comparison.compiled


def test_approximated_run_is_measured_against_the_zero2_formula() -> None:
    from zerobridge.compare.api import _formulas

    run = outcome("fsdp/stage1", [1.0], stage=1, approximations=("sharding",), formula_stage=2)
    _formulas(run, 1000, "adam")
    assert run.formula_model_state_bytes == 4 * 1000 + 12 * 1000 // 2  # ZeRO-2 at N = 2, not ZeRO-1's 4P + 12P/N


def test_plan_reads_configs(tmp_path: Path) -> None:
    config = tmp_path / "ds_zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    p = plan(stages=[], configs=[str(config), "zero3"], backends=["native"], nproc=2, steps=2)
    assert [(r.name, r.stage, r.by_stage) for r in p.runs] == [("native/ds_zero2", 2, False),
                                                              ("native/zero3", 3, False)]


def accumulating(tmp_path: Path, stage: int, *, steps: int = 2, **extra: object) -> Path:
    """A DeepSpeed config that accumulates ``steps`` micro-batches of 2 rows per optimizer step."""
    config = tmp_path / f"acc{steps}z{stage}.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": steps, "gradient_clipping": 1.0, **extra}))
    return config


def test_plan_gives_each_run_its_accumulation_steps(tmp_path: Path) -> None:
    p = plan(stages=[3], configs=[str(accumulating(tmp_path, 2))], backends=["native", "deepspeed"], nproc=2, steps=2)
    assert [(r.name, r.accumulation) for r in p.runs] == [("native/stage3", 1), ("deepspeed/stage3", 1),
                                                          ("native/acc2z2", 2), ("deepspeed/acc2z2", 2)]


def test_accumulation_that_does_not_split_a_ranks_rows_is_bad_input(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = accumulating(tmp_path, 2, steps=3)  # 8 rows over 2 processes: 4 rows, not 3 micro-batches
    assert main(["compare", "--config", str(config), "--backends", "native"]) == 2
    err = capsys.readouterr().err
    assert "acc3z2 accumulates 3 micro-batches per step, but each of 2 processes gets 4 rows" in err
    assert "make the global batch a multiple of 6" in err and "[1/" not in err


def test_micro_batches_cut_a_ranks_rows_in_order() -> None:
    import torch

    from zerobridge.compare.worker import micro_batches

    x, y = torch.arange(8).reshape(4, 2), torch.arange(4)
    cut = micro_batches((x, y), 2)
    assert [m[1].tolist() for m in cut] == [[0, 1], [2, 3]] and cut[1][0].tolist() == [[4, 5], [6, 7]]
    assert micro_batches((y,), 1)[0][0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("argv, message", [
    (["--stages", "4"], "a ZeRO stage is 0, 1, 2 or 3"),
    (["--nproc", "3"], "does not split over 3 processes"),
    (["--steps", "0"], "need at least one step"),
    (["--model", "nope"], "neither the built-in model nor pkg.module:factory"),
    (["--model", "tiny-gpt:1b"], "unknown preset '1b'"),
    (["--model", "no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
    (["--model", "zerobridge.testing.parity:ParityNet"], "returned ParityNet, not a Workload"),
    (["--model", "zerobridge.testing.workloads:parity_workload", "--global-batch", "4"], "built-in model only"),
    (["--stages", "1", "2", "--backends", "fsdp", "--exact-only"], "nothing to compare: every combination was skipped"),
    (["--config", "missing.json"], "missing.json"),
    (["--tolerance", "-1"], "non-negative"),
    (["--norm-tolerance", "nan"], "--norm-tolerance nan: must be a non-negative number"),
    (["--clip", "-1"], "--clip -1.0: must be positive"),
])
def test_bad_input_exits_2_before_any_run(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "[1/" not in err


def test_unwritable_output_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--json", str(tmp_path)]) == 2  # a directory
    assert "cannot write here" in capsys.readouterr().err


def test_unknown_backend_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--backends", "megatron"])
    assert exc.value.code == 2


def test_plan_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="named twice"):
        plan(stages=[3, 3], backends=["native"], nproc=2, steps=1)


# --- real runs ------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_compare_agrees_across_backends_and_matches_one_process(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.testing.gpt import reference_gpt

    out, md = tmp_path / "r.json", tmp_path / "r.md"
    code = main(["compare", "--stages", "1", "3", "--steps", "4", "--json", str(out), "--markdown", str(md)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    data = json.loads(out.read_text())
    assert data["ok"] and data["reference"] == "native/stage1"
    assert [r["name"] for r in data["runs"]] == ["native/stage1", "fsdp/stage1", "deepspeed/stage1", "native/stage3",
                                                 "fsdp/stage3", "deepspeed/stage3"]
    assert data["skipped"] == [] and data["approximated"] == ["fsdp/stage1"]  # FSDP2's closest form, judged too
    assert data["max_loss_deviation"] <= 1e-5
    reference = reference_gpt(steps=4)  # one process, the whole batch, the same AdamW and clipping
    for run in data["runs"]:
        assert run["error"] is None and run["world_size"] == 2
        assert run["losses"] == pytest.approx(reference.losses, rel=1e-5)
        assert run["grad_norms"] == pytest.approx(reference.grad_norms, rel=1e-5)
        assert run["peak_rss_bytes"] > run["baseline_rss_bytes"] > 0 and run["step_time_s"] > 0
        assert len(run["step_times_s"]) == 4
    native3 = next(r for r in data["runs"] if r["name"] == "native/stage3")
    # native stage 3 holds the ZeRO formula 16P/N (tiny GPT: P = 118,400, N = 2): 4P/N of parameters and of
    # gradients exactly, 8P/N of Adam moments plus AdamW's 4-byte step counter per parameter tensor ...
    assert native3["formula_model_state_bytes"] == 16 * 118_400 // 2
    held = native3["model_state_bytes"]
    assert held["params"] == held["grads"] == 4 * 118_400 // 2
    assert 0 < held["optimizer"] - 8 * 118_400 // 2 <= 4 * 40
    # ... and moves parameters twice (forward, backward) and gradients once per step.
    assert native3["comm_bytes"]["all_gather"] == 2 * native3["comm_bytes"]["reduce_scatter"] == 4 * 118_400
    # The independent measure (live storages by role, the same code for every engine) agrees with the
    # engines' own accounting where roles are plain tensors, and is there for DeepSpeed too.
    for run in data["runs"]:
        assert set(run["live_bytes"]) == {"params", "grads", "optimizer", "other"}, run["name"]
    for name in ("native/stage3", "fsdp/stage3", "native/stage1"):
        run = next(r for r in data["runs"] if r["name"] == name)
        assert run["live_mismatch"] < 0.05 and run["live_bytes"]["grads"] == run["model_state_bytes"]["grads"]
    # DeepSpeed at stage 3 allocates a flat reduce bucket (the stated 5e8 elements are written at the model's
    # size: translate/deepspeed_buckets.py) and writes the gradients into it: what the process holds stays below
    # its resident set, and beyond the engine's own report only by the gathered parameters its prefetch cache
    # keeps and the bucket (4P bytes each) and a few small buffers.
    ds3 = next(r for r in data["runs"] if r["name"] == "deepspeed/stage3")
    live, own = sum(ds3["live_bytes"].values()), sum(ds3["model_state_bytes"].values())
    assert live <= ds3["peak_rss_bytes"] and own <= live <= own + 2 * 4 * 118_400 + 2**18, (live, own)
    assert "live (gc)" in captured.out
    # FSDP2's ZeRO-1 form shards parameters at rest too: less than the ZeRO-2 formula it is measured against.
    fsdp1 = data["runs"][1]
    assert fsdp1["formula_stage"] == 2 and fsdp1["formula_model_state_bytes"] == 4 * 118_400 + 12 * 118_400 // 2
    assert sum(fsdp1["model_state_bytes"].values()) < fsdp1["formula_model_state_bytes"]
    assert "[6/6] deepspeed/stage3" in captured.err and "fsdp/stage1 ~" in captured.out
    assert "OK: 6 run(s) agree" in captured.out and "built successfully" not in captured.out + captured.err
    assert "| `native/stage1` |" in md.read_text()


@pytest.mark.distributed
@pytest.mark.slow
def test_compare_accumulates_on_every_backend_and_stage_like_one_process(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.testing.gpt import reference_gpt

    configs = [str(accumulating(tmp_path, stage)) for stage in (0, 1, 2, 3)]
    out = tmp_path / "r.json"
    code = main(["compare", "--config", *configs, "--backends", "native", "fsdp", "deepspeed", "--steps", "3",
                 "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 12 and data["failed"] == [] and data["skipped"] == []
    # Two micro-batches of a step's rows, gradients averaged over them: the whole batch's mean gradient,
    # so every run trains as one process on the whole batch (3 optimizer steps, not 6).
    reference = reference_gpt(steps=3)
    for run in data["runs"]:
        assert run["losses"] == pytest.approx(reference.losses, rel=1e-5), run["name"]
        assert run["grad_norms"] == pytest.approx(reference.grad_norms, rel=1e-5), run["name"]


@pytest.mark.distributed
def test_summed_micro_batches_diverge_at_the_first_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["compare", "--config", str(accumulating(tmp_path, 2)), "--backends", "fsdp", "native", "--steps",
                 "2", "--model", "zerobridge.testing.workloads:undivided_accumulation", "--json", str(out)])
    assert code == 1, capsys.readouterr().out
    (broken,) = json.loads(out.read_text())["divergences"]
    assert (broken["run"], broken["step"], broken["metric"]) == ("native/acc2z2", 0, "grad_norm")
    assert broken["value"] == pytest.approx(2 * broken["reference"], rel=1e-5)  # summed, not averaged


@pytest.mark.distributed
def test_bf16_accumulation_is_calibrated_by_a_one_process_run_that_accumulates(tmp_path: Path) -> None:
    # train_batch_size fits 2 processes only: the one-process rerun keeps the 2 micro-batches, not the sizes
    config = accumulating(tmp_path, 3, bf16={"enabled": True}, train_batch_size=8)
    out = tmp_path / "r.json"
    assert main(["compare", "--config", str(config), "--backends", "native", "--steps", "2", "--json",
                 str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and "one-process bf16 rerun" in data["tolerances"]["bf16"]["source"]


@pytest.mark.distributed
def test_bf16_against_fp32_diverges_and_names_run_and_step(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bf16.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    out = tmp_path / "r.json"
    out.write_text("earlier results\n")
    code = main(["compare", "--stages", "3", "--config", str(config), "--backends", "native", "--steps", "2",
                 "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "native/bf16 diverges from native/stage3 at step 0: loss" in captured.out
    data = json.loads(out.read_text())
    assert not data["ok"] and data["runs"][1]["diverged_at"]["step"] == 0
    assert 1e-5 < data["max_loss_deviation"] < 2e-2  # bf16 rounding, not garbage
    # the same runs pass with a bf16 tolerance
    assert main(["compare", "--stages", "3", "--config", str(config), "--backends", "native", "--steps", "2",
                 "--tolerance", "2e-2", "--norm-tolerance", "5e-2"]) == 0


def test_bf16_runs_are_judged_by_their_calibrated_bounds_fp32_by_the_fixed_ones() -> None:
    from zerobridge.compare.tolerance import calibrated
    from zerobridge.spec import PrecisionSpec

    def bf16(run: RunOutcome) -> RunOutcome:
        spec = run.planned.spec.model_copy(update={"precision": PrecisionSpec(param_dtype="bf16")})
        run.planned = Planned(run.planned.name, run.planned.backend, run.planned.label, 3, spec, False)
        return run

    drift = calibrated(loss_deviation=[0.0, 1e-5, 3e-5], norm_deviation=[0.0] * 3, dtype="bf16")
    ref, near = bf16(outcome("native/a", [1.0, 1.0, 1.0])), bf16(outcome("fsdp/a", [1.0, 1.00005, 1.0002]))
    result = comparison(ref, near)
    result.derived, result.tolerances["bf16"] = (True, True), drift
    assert [result.bound(near, "loss", s) for s in range(3)] == drift.loss
    assert result.ok, result.verdict()
    assert "bf16: tolerance 1.0e-05 to 3.0e-04 on losses" in result.verdict()
    far = bf16(outcome("fsdp/b", [1.0, 1.0005, 1.0]))
    assert comparison(ref, far).divergences[0].step == 1, "fixed fp32 bounds when none were derived"
    result = comparison(ref, far)
    result.derived, result.tolerances["bf16"] = (True, True), drift
    assert result.divergences[0].step == 1 and result.divergences[0].tolerance == pytest.approx(1e-4)
    fp32 = outcome("native/stage3", [1.0, 1.00005, 1.0])  # fp32 against fp32: the fixed 1e-5 still holds
    result = comparison(outcome("native/ref", [1.0, 1.0, 1.0]), fp32)
    result.derived, result.tolerances["bf16"] = (True, True), drift
    assert result.divergences[0].step == 1 and result.divergences[0].tolerance == pytest.approx(1e-5)


@pytest.mark.distributed
def test_bf16_backends_agree_within_derived_bounds_and_a_dropped_reduction_fails_where_it_breaks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.testing.workloads import BROKEN_STEP

    config = tmp_path / "bf16z0.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    out = tmp_path / "r.json"
    assert main(["compare", "--config", str(config), "--backends", "native", "deepspeed", "--steps", "8",
                 "--json", str(out)]) == 0, capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["max_loss_deviation"] > 1e-5 or data["max_grad_norm_deviation"] > 1e-4, \
        "DeepSpeed's bf16 runs leave the fp32 bounds: the derived ones are what let them pass"
    assert "one-process bf16 rerun" in data["tolerances"]["bf16"]["source"]
    assert "bf16: tolerance" in capsys.readouterr().out
    native = next(r for r in data["runs"] if r["name"] == "native/bf16z0")
    # DeepSpeed's layout after backward: 16-bit parameters and gradients, fp32 master and moments,
    # on the formula (the fp32 gradient copy waits for the step), and the live storages agree.
    held = sum(native["model_state_bytes"].values())
    assert held / native["formula_model_state_bytes"] < 1.02 and native["live_mismatch"] < 0.05
    code = main(["compare", "--config", str(config), "--backends", "fsdp", "native", "--steps", "6",
                 "--model", "zerobridge.testing.workloads:dropped_reduction", "--json", str(out)])
    assert code == 1
    broken = json.loads(out.read_text())["divergences"]
    assert [(d["run"], d["step"]) for d in broken] == [("native/bf16z0", BROKEN_STEP)]


@pytest.mark.distributed
def test_failed_run_is_reported_with_its_output_and_the_others_still_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", "--model", "zerobridge.testing.workloads:faulty_workload", "--stages", "3",
                 "--backends", "fsdp", "native", "--steps", "2", "--timeout", "60"])
    captured = capsys.readouterr()
    assert code == 3  # failed, not disagreeing: the run that finished has nothing to disagree with
    assert "failed fsdp/stage3: rank 1: RuntimeError: faulty_workload: rank 1 fails under fsdp" in captured.out
    assert "[2/2] native/stage3" in captured.err and "2 steps in" in captured.err
    log = Path(captured.out.split("(output: ")[1].split(")")[0].replace("*", "1"))
    try:
        assert "RuntimeError: faulty_workload: rank 1 fails under fsdp" in log.read_text()
    finally:
        shutil.rmtree(log.parent)


def test_the_command_line_registers_compare_without_importing_torch() -> None:
    import subprocess

    code = "import sys\nfrom zerobridge.cli import _parser\n_parser()\nprint('torch' in sys.modules)\n"
    assert subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip() == "False"


@pytest.mark.distributed
def test_quantized_runs_are_judged_by_the_drift_from_their_unquantized_twin(tmp_path: Path) -> None:
    plain = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "communication_data_type": "bf16"}
    zeropp = {**plain, "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                             "zero_quantized_gradients": True}}
    paths = []
    for name, config in (("plain", plain), ("zeropp", zeropp)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(config))
    out = tmp_path / "r.json"
    assert main(["compare", "--config", *map(str, paths), "--backends", "native", "--steps", "4", "--json",
                 str(out)]) == 0
    data = json.loads(out.read_text())
    kind = "bf16 gather=int8 reduce=int4"
    assert "from the same run unquantized" in data["tolerances"][kind]["source"]
    assert data["tolerances"][kind]["loss"][-1] > data["tolerances"]["bf16"]["loss"][-1]
    runs = {r["name"]: r for r in data["runs"]}
    moved = {name: sum(r["comm_bytes"].values()) for name, r in runs.items()}
    assert moved["native/zeropp"] < 0.7 * moved["native/plain"]  # 118k parameters: control all-reduces weigh in
