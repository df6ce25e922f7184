"""``precision.compute_copy`` through every translator: each flavor's readers set its layout
(DeepSpeed stored; FSDP1, FSDP2, torchtitan, DDP under autocast gathered) and report it,
writers report the other layout as equivalent (same numbers, other memory), and the corpus reads the same way.
No process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import corpus_dir, corpus_files, in_original_layout

from zerobridge.load import load_spec
from zerobridge.spec import ShardingSpec, StrategySpec
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.formats import write
from zerobridge.translate.fsdp1 import read_fsdp1
from zerobridge.translate.fsdp2 import read_fsdp2
from zerobridge.translate.lightning import read_lightning, write_lightning
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located, parse_toml, parse_yaml
from zerobridge.translate.torchtitan import read_torchtitan

FLAVOR_TARGETS = {"deepspeed": "stored", "accelerate-deepspeed": "stored", "fsdp1": "gathered",
                  "fsdp2": "gathered", "accelerate-fsdp": "gathered"}
"""Each writer and the layout its consumer keeps."""


def layout_entries(report: Report) -> list[Any]:
    return [e for e in report if e.key == "precision.compute_copy" or e.target == "precision.compute_copy"]


def assert_read(t: Translation[StrategySpec], layout: str) -> None:
    assert t.value.precision.compute_copy == layout
    entries = layout_entries(t.report)
    assert [e.status for e in entries] == [Status.EXACT], entries
    assert f"compute_copy {layout}" in entries[0].note


def spec(dtype: str, layout: str, stage: int = 3) -> StrategySpec:
    return StrategySpec.model_validate({"sharding": ShardingSpec.for_stage(stage, world_size=8).model_dump(),
                                        "precision": {"param_dtype": dtype, "compute_copy": layout}})


# ------------------------------------------------------------------------------------------ readers

@pytest.mark.parametrize("section", ["bf16", "fp16"])
def test_deepspeed_mixed_precision_reads_as_stored(section: str) -> None:
    t = read_deepspeed(Located({"zero_optimization": {"stage": 3}, section: {"enabled": True}}, "ds.json"))
    assert_read(t, "stored")
    assert layout_entries(t.report)[0].key == f"{section}.enabled"


def test_deepspeed_auto_precision_reads_as_stored() -> None:
    t = read_deepspeed(Located({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, "ds.json"))
    assert_read(t, "stored")


@pytest.mark.parametrize("fmt,data", [
    ("fsdp2", {"mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}),
    ("fsdp1", {"sharding_strategy": "FULL_SHARD", "mixed_precision": {"param_dtype": "float16"}}),
])
def test_fsdp_mixed_precision_reads_as_gathered(fmt: str, data: dict[str, Any]) -> None:
    reader = read_fsdp2 if fmt == "fsdp2" else read_fsdp1
    assert_read(reader(Located(data, f"{fmt}.json")), "gathered")


@pytest.mark.parametrize("t", [
    read_deepspeed(Located({"zero_optimization": {"stage": 3}}, "ds.json")),
    read_deepspeed(Located({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True,
                                                                        "bf16_master_weights_and_grads": True}},
                           "ds.json")),
    read_fsdp2(Located({"mp_policy": {"param_dtype": "float32"}}, "fsdp2.json")),
    read_fsdp2(Located({"mp_policy": {"param_dtype": "bfloat16"},
                        "training_loop": {"master_dtype": "bfloat16"}}, "fsdp2.json")),
], ids=["ds-fp32", "ds-pure-bf16", "fsdp2-fp32", "fsdp2-pure-bf16"])
def test_one_copy_reads_as_stored_without_a_layout_entry(t: Translation[StrategySpec]) -> None:
    assert t.value.precision.compute_copy == "stored"
    assert layout_entries(t.report) == []


@pytest.mark.parametrize("yaml_text,layout", [
    ("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n",
     "gathered"),
    ("distributed_type: FSDP\nmixed_precision: fp16\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n"
     "  fsdp_sharding_strategy: FULL_SHARD\n", "gathered"),
    ("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n",
     "stored"),
    ("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 2\n", "gathered"),
], ids=["fsdp2", "fsdp1", "deepspeed", "ddp"])
def test_accelerate_reads_the_layout_of_its_flavor(yaml_text: str, layout: str) -> None:
    assert_read(read_accelerate(parse_yaml(yaml_text, "accelerate.yaml")), layout)


@pytest.mark.parametrize("name,layout", [("fsdp", "gathered"), ("deepspeed_stage_3", "stored"),
                                         ("ddp", "gathered")])
def test_lightning_reads_the_layout_of_its_strategy(name: str, layout: str) -> None:
    assert_read(read_lightning(name, precision="bf16-mixed"), layout)
    true = read_lightning(name, precision="bf16-true")
    if name.startswith("deepspeed"):  # DeepSpeed keeps fp32 masters under bf16-true too
        assert_read(true, "stored")
    else:  # the model itself is cast: one copy
        assert true.value.precision.compute_copy == "stored" and layout_entries(true.report) == []


def test_torchtitan_reads_as_gathered() -> None:
    text = '[training]\nmixed_precision_param = "bfloat16"\n[parallelism]\ndata_parallel_shard_degree = 2\n'
    assert_read(read_torchtitan(parse_toml(text, "job.toml")), "gathered")


# ------------------------------------------------------------------------------------------ writers

@pytest.mark.parametrize("target", sorted(FLAVOR_TARGETS))
@pytest.mark.parametrize("layout", ["stored", "gathered"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_writers_report_the_other_layout_as_equivalent(target: str, layout: str, dtype: str) -> None:
    report = write(spec(dtype, layout), target).report
    entries = layout_entries(report)
    if FLAVOR_TARGETS[target] == layout:
        assert entries == []
    else:
        assert [e.status for e in entries] == [Status.EQUIVALENT], entries
        assert f"written as {FLAVOR_TARGETS[target]}" in entries[0].note


def test_writers_say_nothing_without_mixed_precision() -> None:
    for target in FLAVOR_TARGETS:
        assert layout_entries(write(spec("fp32", "stored"), target).report) == []


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lightning_choice_does_not_follow_the_layout(stage: int) -> None:
    stored, gathered = (write_lightning(spec("bf16", layout, stage)) for layout in ("stored", "gathered"))
    assert stored.value == gathered.value
    cls = stored.value["class"]
    kept = "stored" if cls == "DeepSpeedStrategy" else "gathered"
    for t, layout in ((stored, "stored"), (gathered, "gathered")):
        entries = layout_entries(t.report)
        assert [e.status for e in entries] == ([] if layout == kept else [Status.EQUIVALENT]), (cls, entries)
        assert not [e for e in t.report if e.status is Status.NOT_EXPRESSIBLE and "compute_copy" in e.key]


@pytest.mark.parametrize("layout", ["stored", "gathered"])
def test_round_trip_through_the_own_flavor_keeps_the_layout(layout: str) -> None:
    for target, kept in FLAVOR_TARGETS.items():
        if kept != layout:
            continue
        written = write(spec("bf16", layout), target).value
        fmt = {"accelerate-deepspeed": "accelerate", "accelerate-fsdp": "accelerate"}.get(target, target)
        back = read_accelerate(Located(written, "<written>")) if fmt == "accelerate" else \
            load_spec(written, fmt=fmt)
        assert back.value.precision.compute_copy == layout, target


# ------------------------------------------------------------------------------------------ corpus

CORPUS = corpus_files("deepspeed") + corpus_files("accelerate") + corpus_files("torchtitan")


def flavor_layout(path: Path, t: Translation[StrategySpec]) -> str:
    if "deepspeed" in path.parent.name:
        return "stored"
    if "torchtitan" in path.parent.name:
        return "gathered"
    text = path.read_text(encoding="utf-8")
    return "stored" if "DEEPSPEED" in text else "gathered"


@pytest.mark.corpus
@pytest.mark.skipif(corpus_dir() is None, reason="no ../shared/corpus (set ZEROBRIDGE_CORPUS)")
def test_every_corpus_file_reads_its_flavors_layout(tmp_path: Path) -> None:
    mixed: dict[str, int] = {}
    for path in CORPUS:
        here = tmp_path / path.name
        here.mkdir()
        t = load_spec(in_original_layout(path, here))
        p = t.value.precision
        if not (p.mixed or p.param_dtype == "auto"):
            assert p.compute_copy == "stored" and layout_entries(t.report) == [], path.name
            continue
        layout = flavor_layout(path, t)
        mixed[layout] = mixed.get(layout, 0) + 1
        assert_read(t, layout)
        for target, kept in FLAVOR_TARGETS.items():
            entries = layout_entries(write(t.value, target).report)
            # raw FSDP has no launcher: "auto" is written as the loaded fp32, one copy
            other = kept != layout and not (p.param_dtype == "auto" and target in ("fsdp1", "fsdp2"))
            assert [e.status for e in entries] == ([Status.EQUIVALENT] if other else []), \
                (path.name, target, entries)
    assert mixed.get("stored", 0) >= 10 and mixed.get("gathered", 0) >= 5, mixed
