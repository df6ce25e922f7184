"""``zerobridge plan --flavor``: each flavor's planned peak within 10% of that flavor's real peak (issue 31).

Real peaks: ``zerobridge.testing.flavor_peaks`` on gloo, world 2, 2 x 128 tokens, the plan's
``StorageTracker`` counting live tensor bytes; one launch per flavor, several configs each. Planned:
``zerobridge.plan(..., flavor=...)`` on fake tensors. The buffer model's terms need no process group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from zerobridge.cli import main
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster
from zerobridge.planning import Plan, plan
from zerobridge.planning.candidates import candidates, deepspeed_form, with_checkpointing
from zerobridge.planning.deepspeed_memory import deepspeed_config
from zerobridge.planning.deepspeed_terms import DeepSpeedBuffers, buffers_for, stage1_kept
from zerobridge.planning.fake_run import Measured, Run
from zerobridge.planning.flavors import (
    FLAVORS,
    NOT_MODELLED,
    FlavorMeasured,
    flavor_for_target,
    measure_flavor,
    measure_once,
)
from zerobridge.planning.models import resolve_model
from zerobridge.planning.report import render
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.translate.run_level import with_run_settings

WORLD, MICRO_BATCH, SEQ_LEN, WITHIN = 2, 2, 128, 0.10
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 352,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
         "max_position_embeddings": 512, "tie_word_embeddings": True}
"""A Hugging Face architecture the rest of the suite does not build (Qwen2, tied embeddings)."""
CELLS = {("deepspeed", 2): [("tiny-llama", "zero1", "bf16"), ("tiny-llama", "zero2", "fp32"),
                            ("tiny-llama", "zero3+ac", "fp32"), ("tiny-llama", "zero3+ac", "bf16"),
                            ("qwen2", "zero1+ac", "fp32"), ("qwen2", "zero2+ac", "bf16"), ("qwen2", "zero3", "bf16"),
                            ("tiny-gpt:20m", "zero2+ac", "fp32"), ("tiny-gpt:20m", "zero3", "bf16"),
                            ("tiny-gpt:20m", "zero3+ac", "fp32")],
         ("fsdp2", 2): [("tiny-llama", "zero2", "fp32"), ("tiny-llama", "zero3+ac", "bf16"), ("qwen2", "zero3", "fp32"),
                        ("qwen2", "zero2+ac", "bf16"), ("tiny-gpt:20m", "zero3+ac", "fp32")],
         ("deepspeed", 4): [("tiny-llama", "zero1+ac", "fp32"), ("tiny-llama", "zero2+ac", "fp32"),
                            ("tiny-llama", "zero3", "bf16")],
         ("fsdp2", 4): [("tiny-llama", "zero2", "bf16"), ("tiny-llama", "zero3+ac", "fp32")]}
"""(model, candidate, precision) per flavor and world size; FSDP2's zero2 is its closest form
(reshard_after_forward=False). The issue's three models (the 20M GPT, a tiny Llama, a Qwen2 config), stages 1 to 3
with and without checkpointing, fp32 and bf16, at world 2 and 4; bench/plan_flavors.py runs every cell."""


# ----------------------------------------------------------------------- the buffer model's terms


def test_deepspeed_terms() -> None:
    fp32 = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                             "reduce_bucket_size": 1000}}
    b = buffers_for(fp32, params=10_001, world_size=2)
    # an fp32 master partition apart from the fp32 parameters; two reduce buckets with overlap_comm
    assert (b.master_copy, b.grad_partition, b.reduce_buckets, b.fp32_grad_copy) == (20_004, 20_004, 8000, 0)
    assert b.resident == 20_004  # stage 2: buckets and partition live per backward, not from setup
    # AdamW on the one flat fp32 partition: sqrt and quotient, two partition-sized temporaries at once
    assert b.adam_temporaries == 2 * 20_004
    # stage 1 holds stage 2's buffers (gradients moved into the buckets as they are produced)
    assert buffers_for(fp32 | {"zero_optimization": fp32["zero_optimization"] | {"stage": 1}}, params=10_001,
                       world_size=2).model_dump() == b.model_dump() | {"stage": 1}
    # stage 3 flattens the gradient partition for the step: an fp32 copy in an fp32 run too
    assert buffers_for(fp32 | {"zero_optimization": {"stage": 3}}, params=10_001, world_size=2).fp32_grad_copy \
        == 20_004
    bf16 = fp32 | {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                                   "stage3_param_persistence_threshold": 10}}
    b = buffers_for(bf16, params=10_000, world_size=4, persistent_params=100)
    # stage 3: one preallocated flat bucket, the flat gradient partition, persistent parameters whole
    assert (b.master_copy, b.reduce_buckets, b.fp32_grad_copy, b.persistent) == (0, 2000, 10_000, 150)
    assert b.resident == 5000 + 2000 + 150
    # stage 1 keeps its large gradients outside the partition until the step, in the parameters' dtype
    stage1 = fp32 | {"zero_optimization": fp32["zero_optimization"] | {"stage": 1}}
    assert buffers_for(stage1, params=10_001, world_size=2, kept=300).kept_grads == 1200
    assert buffers_for(fp32, params=10_001, world_size=2, kept=300).kept_grads == 0


def _deepspeed_beside_native(candidate: str, precision: str, optimizer: str = "adamw", world: int = WORLD
                             ) -> tuple[Measured, Measured, DeepSpeedBuffers]:
    """The tiny Llama's ``candidate`` planned on DeepSpeed and on the native engine, and DeepSpeed's terms."""
    spec = _spec("tiny-llama", candidate, precision, "deepspeed", world)
    source, template = resolve_model("tiny-llama"), resolve_model("tiny-llama").build()
    run = Run(world_size=world, nodes=1, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, optimizer=optimizer)
    deepspeed, native = (measure_flavor(source, spec, run, False, f).measured for f in ("deepspeed", "native"))
    assert deepspeed is not None and native is not None
    terms = buffers_for(deepspeed_config(spec, template, world), params=sum(p.numel() for p in template.parameters()),
                        world_size=world)
    return deepspeed, native, terms


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_stage3_forward_is_the_native_forward_and_deepspeeds_resident_buffers(precision: str) -> None:
    """After the first step the native gradient shard stands for stage 3's flat gradient partition: the
    forward holds the native run's bytes plus DeepSpeed's master copy and flat bucket, nothing twice (the
    partition added back after each step planned the 20M GPT's forward one partition, 38.3 MiB, over)."""
    deepspeed, native, terms = _deepspeed_beside_native("zero3", precision)
    assert terms.grad_partition > 0
    assert deepspeed.peaks["forward"] - native.peaks["forward"] == \
        terms.master_copy + terms.reduce_buckets + terms.persistent


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_stage2_frees_its_gradient_partition_after_each_step(precision: str) -> None:
    """DeepSpeed's stages 1-2 free their gradient partition with the step, where the native engine keeps its
    gradient shard: the model frees the native shard after each step, so the forward holds the native run's
    bytes less that shard plus DeepSpeed's master copy (the same size in fp32). And with a fused AdamW
    (``--optimizer adamw-fused``, Trainer's default) the step holds no temporaries of its own, and peaks at the
    flat copy of the partition's gradients instead (measured on real DeepSpeed: 57.3 MiB against 66.8 with
    torch's AdamW, tiny Llama, bf16 with checkpointing)."""
    deepspeed, native, terms = _deepspeed_beside_native("zero2", precision)
    assert deepspeed.peaks["forward"] - native.peaks["forward"] == terms.master_copy - terms.grad_partition
    fused, _, _ = _deepspeed_beside_native("zero2", precision, optimizer="adamw-fused")
    assert terms.adam_temporaries > 0 and terms.flat_copy == terms.grad_partition
    # torch's AdamW peaks with its two temporaries beside the fp32 gradient (fp32: the flat copy itself); a fused
    # one makes none, and peaks where the flat copy (16-bit: and its fp32 cast) sits beside the partition
    fp32_grad = terms.fp32_grad_copy or terms.flat_copy
    assert deepspeed.peaks["step"] - fused.peaks["step"] == \
        fp32_grad + terms.adam_temporaries - (terms.grad_partition + terms.flat_copy + terms.fp32_grad_copy)


def test_deepspeed_stage1_keeps_large_gradients_outside_its_partition_until_the_step() -> None:
    """DeepSpeed's stage 1 clears the gradients of parameters outside the rank's partition only at the step,
    and one larger than the reduce bucket keeps its own tensor (``kept_grads``): the backward holds more than
    stage 2's, at most those bytes, and the step no more (real DeepSpeed on 4 ranks, the tiny Llama in fp32
    with checkpointing: 4.0 to 7.8 MiB more per rank than at stage 2; planned without them, 7.8% under)."""
    stage1, _, _ = _deepspeed_beside_native("zero1+ac", "fp32", world=4)
    stage2, _, terms = _deepspeed_beside_native("zero2+ac", "fp32", world=4)
    numels = [p.numel() for p in resolve_model("tiny-llama").build().parameters()]
    kept = stage1_kept(numels, world_size=4, bucket=256 * 256)  # the JSON's reduce bucket: hidden_size^2
    assert kept == [0, 5, 6, 7, 14, 15, 16, 34, 38]  # rank 2 of 4 leaves out most: embedding, head, 7 MLP weights
    assert 0 < stage1.peaks["backward"] - stage2.peaks["backward"] <= terms.dtype_bytes * sum(numels[i] for i in kept)
    assert stage1.peaks["step"] == stage2.peaks["step"]


def test_a_dtensor_counts_its_local_shard_not_its_global_size() -> None:
    """A DTensor's own storage has the global size and no memory behind it: counted, the plan's FSDP2
    column weighed every sharded parameter, gradient and Adam moment N times (a 70B Llama at world 64:
    994 GB at ZeRO-3 where the native engine plans 160 GB)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from zerobridge.planning.fake_run import fake_world
    from zerobridge.planning.tracker import StorageTracker

    with fake_world(4, 4):
        mesh = init_device_mesh("cpu", (4,))
        local = torch.zeros(256, 4)  # this rank's shard: 4 KiB of a 16 KiB parameter
        with StorageTracker() as tracker:
            tracker.adopt([DTensor.from_local(local, mesh, [Shard(0)], run_check=False)])
            assert tracker.live == local.nbytes
            doubled = DTensor.from_local(local, mesh, [Shard(0)], run_check=False) * 2  # a DTensor op's output
            assert isinstance(doubled, DTensor) and doubled.shape == (1024, 4)
            assert tracker.live == 2 * local.nbytes
            del doubled
            assert tracker.live == local.nbytes


def test_a_meta_tensor_holds_no_memory_and_a_fake_one_does() -> None:
    """DeepSpeed keeps a meta tensor per parameter at stages 1-2 (``round_robin_bit16_meta``): counted, every
    real DeepSpeed peak held a second copy of the parameters (19.1 MiB on the tiny Llama in fp32)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerobridge.planning.tracker import StorageTracker

    with StorageTracker() as tracker:
        shapes = [torch.zeros_like(torch.empty(0).new_empty(1024), device="meta") for _ in range(4)]
        assert tracker.live == 0 and all(t.is_meta for t in shapes)
        real = torch.zeros(1024)
        assert tracker.live == real.nbytes
        with FakeTensorMode():
            fake = torch.zeros(1024)  # a plan's stand-in for real memory: its storage is meta, the tensor is not
        assert tracker.live == 2 * real.nbytes
        del fake
        assert tracker.live == real.nbytes


def test_deepspeed_sub_groups_are_cut_as_deepspeed_cuts_them() -> None:
    from zerobridge.planning.deepspeed_terms import largest_sub_group

    # partitions on 2 ranks: 5, 3, 2, 4, 1; a sub-group closes once it holds 4 or more
    assert largest_sub_group([10, 5, 4, 8, 1], world_size=2, sub_group_size=4) == 5  # [5] [3, 2] [4] [1]
    assert largest_sub_group([10, 5, 4, 8, 1], world_size=2, sub_group_size=10**9) == 15  # one group
    fp32 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    whole, cut = (buffers_for(fp32, params=20_000, world_size=2, sub_group=g) for g in (None, 1000))
    assert (whole.fp32_grad_copy, whole.adam_temporaries) == (40_000, 80_000)
    assert (cut.fp32_grad_copy, cut.adam_temporaries) == (4000, 8000)


def test_targets_name_their_flavor() -> None:
    assert [flavor_for_target(t) for t in ("deepspeed", "trainer-deepspeed", "fsdp2", "accelerate-fsdp", "spec")] \
        == ["deepspeed", "deepspeed", "fsdp2", "fsdp2", "native"]


def test_deepspeed_leaves_out_what_it_does_not_model_and_fsdp2_marks_its_approximations() -> None:
    ds = plan("tiny-gpt", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=16, workers=1,
              flavor="deepspeed")
    assert {r.name for r in ds.rows} == {"zero1", "zero2", "zero3", "zero1+ac", "zero2+ac", "zero3+ac"}
    assert all(r.flavor == "deepspeed" for r in ds.rows) and any("zero0" in n and "stage 0" in n for n in ds.notes)
    with pytest.raises(ConfigError, match="stage 1 with gradient accumulation"):  # full gradients between boundaries
        plan("tiny-gpt", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=16, workers=1, accumulation=2,
             flavor="deepspeed", strategies=["zero1"], only_own=True)
    fsdp = plan("tiny-gpt", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=16, workers=1,
                flavor="fsdp2", strategies=["zero2"], only_own=True)
    assert fsdp.row("zero2").approximation and "ZeRO-2" in fsdp.row("zero2").approximation[0]


def test_fsdp2_runs_one_form_once_with_each_candidates_own_notes() -> None:
    """ZeRO-1, ZeRO-2 and ZeRO-2 with its optimizer offloaded are one FSDP2 run (as is ZeRO-3 with or without
    its optimizer offloaded): a plan measures the form once, and each repeat gets the figures a run of its
    own gives, with its own approximation notes."""
    model = resolve_model("tiny-gpt").build()
    names = ("zero1", "zero2", "zero2-offload", "zero3", "zero3-offload-optimizer")
    made = {c.name: c.spec for c in candidates(model, nodes=1, ranks_per_node=2)}
    run = Run(world_size=2, nodes=1, micro_batch=2, seq_len=16)
    specs = [with_run_settings(made[n], micro_batch=2, accumulation=1, precision="bf16").value.model_copy(
        update={"name": n}) for n in names]
    source = resolve_model("tiny-gpt")
    asked: list[str] = []

    def measure(jobs: list[tuple[StrategySpec, str]]) -> list[FlavorMeasured]:
        asked.extend(str(spec.name) for spec, _ in jobs)
        return [measure_flavor(source, spec, run, False, flavor) for spec, flavor in jobs]

    once = measure_once([(spec, "fsdp2") for spec in specs], run, measure)
    assert asked == ["zero1", "zero3"]
    repeats = (1, 2, 4)
    assert [once[i] for i in repeats] == [measure_flavor(source, specs[i], run, False, "fsdp2") for i in repeats]
    assert once[0].approximation != once[1].approximation != once[2].approximation  # each names its own keys
    assert once[0].measured != once[3].measured and not once[3].approximation


def test_deepspeed_fp16_says_it_is_not_checked() -> None:
    """DeepSpeed's CPU accelerator has no fp16 here: its fp16 figures are bf16's, and the plan says so."""
    result = plan("tiny-gpt", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=16, workers=1,
                  precision="fp16", flavor="deepspeed", strategies=["zero2"], only_own=True)
    assert result.row("zero2").flavor == "deepspeed" and any("fp16 is modelled as bf16" in n for n in result.notes)


def test_fsdp2_plans_a_spec_that_skips_non_finite_steps(tmp_path: Path) -> None:
    """A DeepSpeed bf16 config skips steps with inf/NaN gradients; the FSDP2 step's overflow check must not
    read a fake tensor back (it reads as no overflow, as the native engine's does)."""
    config = tmp_path / "bf16z3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                  "train_micro_batch_size_per_gpu": 2}))
    result = plan("tiny-gpt", world_size=2, device_memory="1GiB", micro_batch=2, seq_len=16, workers=1,
                  flavor="fsdp2", strategies=[str(config)], only_own=True)
    row = result.row("bf16z3")
    assert row.spec.precision.skip_nonfinite_steps and row.flavor == "fsdp2" and row.device_peak > 0


# ----------------------------------------------------------------------- --flavor all: a column per flavor


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _own_configs(folder: Path) -> list[str]:
    """Two specs, checkpointed (so no ``+ac`` forms are added): ZeRO-2 (FSDP2 runs only its closest form) and
    ZeRO-2 with the optimizer on the host (DeepSpeed's memory model leaves offload out)."""
    model = resolve_model("tiny-gpt").build()
    base = deepspeed_form(with_checkpointing(spec_for_stage(2, model), model), model, own=False)[0]
    dumped = base.model_dump()
    offloaded = StrategySpec.model_validate(dumped | {"offload": dumped["offload"] | {
        "optimizer": dumped["offload"]["optimizer"] | {"device": "cpu"}}})
    paths = []
    for name, spec in (("z2", base), ("off", offloaded)):
        path = folder / f"{name}.json"
        path.write_text(StrategySpec.model_validate(spec.model_dump() | {"name": name}).model_dump_json())
        paths.append(str(path))
    return paths


def test_flavor_all_measures_every_candidate_on_every_flavor(tmp_path: Path) -> None:
    result = plan("tiny-gpt", world_size=2, device_memory="64MiB", micro_batch=2, seq_len=16, workers=2,
                  flavor="all", recommend_for="deepspeed", strategies=_own_configs(tmp_path), only_own=True)
    assert result.flavors == FLAVORS and result.flavor == "deepspeed" and result.rows == result.columns["deepspeed"]
    assert result.candidate_names == ("z2", "off")
    native, fsdp2, ds = (result.row("z2", f) for f in FLAVORS)
    # each flavor's own figure: FSDP2 runs its closest form of ZeRO-2 (marked), DeepSpeed adds its buffers
    assert (native.flavor, fsdp2.flavor, ds.flavor) == FLAVORS
    assert fsdp2.approximation and not native.approximation and not ds.approximation
    assert len({native.device_peak, fsdp2.device_peak, ds.device_peak}) == 3
    # a candidate DeepSpeed's model leaves out is a cell of its own, never another flavor's row
    cell, why = result.left_out["deepspeed"]["off"]
    assert cell == NOT_MODELLED and "offload" in why
    with pytest.raises(KeyError):
        result.row("off", "deepspeed")
    assert {f: result.recommended_for(f).flavor for f in FLAVORS} == {f: f for f in FLAVORS}
    lines = render(result).splitlines()
    header = next(line for line in lines if line.startswith("candidate"))
    assert header.split()[1:4] == list(FLAVORS) and "fits (deepspeed)" in header
    cells = {line.split()[0].lstrip("*"): line.split()[1:7] for line in lines if line.startswith("*")}
    assert cells["z2"][2].startswith("~") and cells["off"][4:6] == ["not", "modelled"]
    # the plan's flavor's recommendation first; one line per flavor, each naming it
    recommended = [line.split()[2].rstrip(":") for line in lines if line.startswith("recommended for ")]
    assert recommended == ["deepspeed", "native", "fsdp2"]
    with pytest.raises(ConfigError, match="--flavor"):
        plan("tiny-gpt", world_size=2, device_memory="64MiB", seq_len=16, flavor="every")
    with pytest.raises(ConfigError, match="not among the flavors planned"):
        plan("tiny-gpt", world_size=2, device_memory="64MiB", seq_len=16, flavor="fsdp2", recommend_for="deepspeed")


def test_cli_flavor_all(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    configs = _own_configs(tmp_path)
    argv = ["plan", "tiny-gpt", "--world-size", "2", "--device-memory", "64MiB", "--micro-batch", "2",
            "--seq-len", "16", "--flavor", "all", "--only-own", "--config"]
    written = tmp_path / "ds.json"
    code, out, err = _cli(capsys, *argv, *configs, "--to", "deepspeed", "-o", str(written), "--json")
    data = json.loads(out)
    # --to deepspeed recommends from DeepSpeed's column, and writes that
    assert code == 0 and data["flavor"] == "deepspeed" and set(data["flavors"]) == set(FLAVORS)
    assert data["recommended"] == "z2" and "wrote z2 as deepspeed" in err and written.is_file()
    assert data["device_peak_by_flavor"]["off"]["deepspeed"] == NOT_MODELLED
    assert all(isinstance(data["device_peak_by_flavor"]["z2"][f], int) for f in FLAVORS)
    assert data["flavors"]["fsdp2"]["candidates"][0]["approximation"]
    assert data["flavors"]["deepspeed"]["left_out"]["off"]["cell"] == NOT_MODELLED
    # nothing DeepSpeed's column can recommend: bad input, the fix named, no traceback
    code, _, err = _cli(capsys, *argv, configs[1], "--to", "deepspeed", "-o", str(written))
    assert code == 2 and "no candidate can be planned on deepspeed" in err and "Traceback" not in err
    assert "--flavor native" in err


# ----------------------------------------------------------------------- against real runs


def _model(name: str, folder: Path) -> str:
    if name != "qwen2":
        return name
    path = folder / "qwen2.json"
    path.write_text(json.dumps(QWEN2))
    return str(path)


def _spec(model: str, name: str, precision: str, flavor: str, world: int = WORLD) -> StrategySpec:
    """The candidate as the plan measures it on ``flavor`` (DeepSpeed: buckets sized for the model)."""
    template = resolve_model(model).build()
    made = {c.name: c.spec for c in candidates(template, nodes=1, ranks_per_node=world)}
    spec = with_run_settings(made[name], micro_batch=MICRO_BATCH, accumulation=1, precision=precision).value
    if flavor == "deepspeed":
        spec = deepspeed_form(spec, template, own=False)[0]
    return spec.model_copy(update={"name": name.replace("+", "-")})


def _planned(model: str, spec: StrategySpec, flavor: str, world: int = WORLD) -> int:
    result: Plan = plan(model, world_size=world, device_memory="1GiB", micro_batch=MICRO_BATCH, seq_len=SEQ_LEN,
                        precision="bf16" if spec.precision.param_dtype == "bf16" else "fp32", workers=1,
                        strategies=[spec], only_own=True, flavor=flavor)
    row = result.row(str(spec.name))
    assert row.flavor == flavor
    return row.device_peak


def _real(flavor: str, world: int, folder: Path) -> dict[tuple[str, str, str], int]:
    """The busier rank's real peak of each cell of ``CELLS[flavor, world]``: one launch, one call per model."""
    out: dict[tuple[str, str, str], int] = {}
    cells = CELLS[flavor, world]
    with Cluster(world, timeout_s=600, env=ENV if flavor == "deepspeed" else None) as cluster:
        for model in dict.fromkeys(c[0] for c in cells):
            path = _model(model, folder)
            mine = [(n, p) for m, n, p in cells if m == model]
            if flavor == "deepspeed":
                template = resolve_model(path).build()
                extra = {"zero_allow_untested_optimizer": True, "steps_per_print": 2**62}
                configs = {f"{n}/{p}": deepspeed_config(_spec(path, n, p, flavor, world), template, world) | extra
                           for n, p in mine}
                ranks: list[Any] = cluster.run("zerobridge.testing.flavor_peaks:deepspeed_peaks", model=path,
                                               configs=configs, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN,
                                               recompute=tuple(k for k in configs if "+ac" in k))
            else:
                specs = {f"{n}/{p}": _spec(path, n, p, flavor, world).model_dump(mode="json") for n, p in mine}
                ranks = cluster.run("zerobridge.testing.flavor_peaks:fsdp_peaks", model=path, specs=specs,
                                    micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, clip=None, approximate=True)
            for name, precision in mine:
                out[(model, name, precision)] = max(r[f"{name}/{precision}"]["train"] for r in ranks)
    return out


def _errors(real: dict[tuple[str, str, str], int], flavor: str, world: int, folder: Path) -> dict[Any, float]:
    return {cell: _planned(_model(cell[0], folder), _spec(_model(cell[0], folder), cell[1], cell[2], flavor, world),
                           flavor, world) / peak - 1 for cell, peak in real.items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flavors")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_deepspeed_plan_within_10_percent_of_real_deepspeed(world: int, folder: Path) -> None:
    """Measured (docs/plan.md, ``bench/plan_flavors.py``): every cell within 10%, -0.3% .. +5.5% over 36
    cells at world 2 and -0.3% .. +3.5% over 12 at world 4. Here ten cells at world 2 and three at world 4."""
    pytest.importorskip("deepspeed")
    errors = _errors(_real("deepspeed", world, folder), "deepspeed", world, folder)
    assert len(errors) == len(CELLS["deepspeed", world])
    assert all(abs(e) <= WITHIN for e in errors.values()), errors


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_plan_within_10_percent_of_real_fsdp2(world: int, folder: Path) -> None:
    """The FSDP2 backend itself runs on fake tensors: measured exact in 44 of 48 cells, within 6.3% in the
    others (world 2 and 4; real FSDP2 runs of one cell move by as much between runs)."""
    errors = _errors(_real("fsdp2", world, folder), "fsdp2", world, folder)
    assert len(errors) == len(CELLS["fsdp2", world])
    assert all(abs(e) <= WITHIN for e in errors.values()), errors
