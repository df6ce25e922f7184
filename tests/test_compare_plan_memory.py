"""``zerobridge compare --plan-memory``: each run's planned peak beside its measured one, counted the same way.

    .venv/bin/python -m pytest -q tests/test_compare_plan_memory.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zerobridge.cli import main
from zerobridge.compare import RunOutcome, plan
from zerobridge.compare.peak_report import peak_json

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.mark.distributed
def test_planned_peak_is_within_10_percent_of_the_measured_peak(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert main(["compare", "--stages", "3", "--backends", "native", "fsdp", "--steps", "2", "--plan-memory",
                 "--json", str(out), "--markdown", str(md)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["name"], r["plan_flavor"]) for r in runs] == [("native/stage3", "native"), ("fsdp/stage3", "fsdp2")]
    for run in runs:
        assert len(run["peak_bytes_per_rank"]) == 2 and run["measured_peak_bytes"] == max(run["peak_bytes_per_rank"])
        assert run["planned_peak_bytes"] > 0 and run["plan_note"] is None
        assert run["peak_error"] == pytest.approx(
            (run["planned_peak_bytes"] - run["measured_peak_bytes"]) / run["measured_peak_bytes"])
        assert abs(run["peak_error"]) <= 0.10, run
    for text in (capsys.readouterr().out, md.read_text()):
        assert "planned (zerobridge plan) vs measured" in text and "fsdp2" in text


def test_a_run_the_plan_cannot_model_gets_a_note_not_a_number() -> None:
    planned = plan(stages=[3], backends=["native"], steps=1, plan_memory=True,
                   model="zerobridge.testing.workloads:parity_workload")
    (peak,) = planned.planned_peaks
    assert peak.bytes is None and peak.note is not None and peak.note.startswith("not modelled: --model")
    assert peak.error(1000) is None


def test_without_the_flag_nothing_is_planned_and_the_json_fields_are_null() -> None:
    planned = plan(stages=[3], backends=["native"], steps=1)
    assert planned.planned_peaks == ()
    fields = peak_json(RunOutcome(planned=planned.runs[0], world_size=2))
    assert set(fields) == {"plan_flavor", "planned_peak_bytes", "measured_peak_bytes", "peak_bytes_per_rank",
                           "peak_error", "plan_note"}
    assert fields["peak_error"] is None and fields["peak_bytes_per_rank"] == []


def test_a_fake_run_that_fails_is_a_note_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerobridge.compare import plan_memory

    def fails(*args: object) -> None:
        raise RuntimeError("aten._local_scalar_dense.default\nmore")

    monkeypatch.setattr(plan_memory, "measure_flavor", fails)
    monkeypatch.setattr(plan_memory, "program_map", lambda *args, **kwargs: fails())  # a process in a group
    (peak,) = plan(stages=[3], backends=["fsdp"], steps=1, plan_memory=True).planned_peaks
    assert peak.bytes is None and peak.flavor == "fsdp2"
    assert peak.note == ("not modelled: the plan's fsdp2 fake run fails on this spec (RuntimeError: "
                         "aten._local_scalar_dense.default); plan it with zerobridge plan to see the whole error")


def test_a_process_already_in_a_group_plans_in_a_program_of_its_own(tmp_path: Path) -> None:
    """The plan runs rank 0 of a fake group; a caller that holds a group (a script that already called
    init_process_group, a test session) gets its planned peaks from a separate program instead of a note."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already holds a group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        (peak,) = plan(stages=[3], backends=["native"], steps=1, plan_memory=True).planned_peaks
    finally:
        dist.destroy_process_group()
    assert peak.bytes is not None and peak.bytes > 0 and peak.note is None, peak
