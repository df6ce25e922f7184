"""backend="fsdp": the spec on real torch FSDP2, against the single-process reference and the native engine.

Every training case runs ``ParityNet`` (tied embedding/head, a frozen layer,
an unused parameter, uneven sizes, two param groups) for 10 steps with the
loop of ``zerobridge.testing.fsdp_run.train`` on gloo, and compares the
per-step loss and global grad norm (1e-5 relative), the held-out loss and
the final full parameters (5e-5 absolute) with ``run_reference``. One
process group of 2 ranks serves the module; the hybrid case starts one of 4.

    .venv/bin/python -m pytest -q tests/test_backend_fsdp.py
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerobridge.backends.fsdp.apply import plan_units
from zerobridge.backends.fsdp.assess import assess
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster
from zerobridge.spec import (
    DynamicLossScale,
    EveryModuleWrap,
    OffloadSpec,
    PrecisionSpec,
    ShardingSpec,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.spec.presets import spec_for_stage
from zerobridge.testing.fsdp_run import BackendRun
from zerobridge.testing.parity import ParityNet, RunResult, run_reference

TRAIN = "zerobridge.testing.fsdp_run:train"
RUN = "zerobridge.testing.fsdp_run"
LOSS_RTOL, PARAM_ATOL = 1e-5, 5e-5
BF16_RTOL = 2e-2
"""bf16 has 8 significant bits (relative step 7.8e-3); 10 steps stay within a few of them."""

STAGE3 = spec_for_stage(3, ParityNet())
"""One unit per ``Layer`` plus the root (ParityNet names its layers in ``_no_split_modules``)."""


def with_(spec: StrategySpec, **fields: Any) -> dict[str, Any]:
    data = spec.model_dump(mode="json")
    for path, value in fields.items():
        section, _, key = path.partition("__")
        if key:
            data[section][key] = value
        else:
            data[section] = value
    return data


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=120) as made:
        yield made


@cache
def reference(accumulation: int = 1, dtype: str = "fp32") -> RunResult:
    return run_reference(accumulation=accumulation, dtype=dtype)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_parity(results: list[Any], ref: RunResult, *, rtol: float = LOSS_RTOL, atol: float = PARAM_ATOL) -> None:
    for rank_result in results:
        assert rank_result.losses == results[0].losses
    got = results[0]
    assert len(got.losses) == len(ref.losses) >= 10
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert rel(a, b) <= rtol, f"loss at step {step}: {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert rel(a, b) <= rtol, f"grad norm at step {step}: {a} vs reference {b}"
    assert rel(got.eval_loss, ref.eval_loss) <= rtol
    assert set(got.state) == set(ref.state)
    for name, value in ref.state.items():
        err = (got.state[name].float() - value).abs().max().item()
        assert err <= atol, f"{name}: max abs error {err}"


# --------------------------------------------------------------------------- no process group


def test_translator_report_decides_what_runs() -> None:
    keys = {stage: [e.key for e in assess(spec_for_stage(stage), world_size=2, local_world_size=2).approximations]
            for stage in range(4)}
    assert keys == {0: [], 1: ["sharding"], 2: ["sharding"], 3: []}
    three = assess(spec_for_stage(3), world_size=4, local_world_size=2)
    assert three.tuning and all(e.key.startswith("communication.") for e in three.tuning)
    hybrid = assess(StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group="node")), world_size=4,
                    local_world_size=2)
    assert hybrid.form["mesh"] == {"shape": [2, 2], "mesh_dim_names": ["dp_replicate", "dp_shard"]}
    assert assess(spec_for_stage(0), world_size=2, local_world_size=2).form["mesh"]["shape"] == [2, 1]


class Shared(nn.Module):
    """A unit that holds its own weight and a weight tied to one outside it."""

    def __init__(self, tied: torch.Tensor) -> None:
        super().__init__()
        assert isinstance(tied, nn.Parameter)
        self.own = nn.Linear(3, 3)
        self.tied = nn.Linear(3, 3, bias=False)
        self.tied.weight = tied


def test_units_are_the_native_ones_or_recorded() -> None:
    net = ParityNet()
    cut = plan_units(net, EveryModuleWrap())
    names = {id(m): n for n, m in net.named_modules()}
    # embed and head hold only the tied weight, which the root owns (as on the native engine)
    assert sorted(names[id(m)] for m in cut.sharded) == sorted(
        ["layers.0.up", "layers.0.down", "layers.0.norm", "layers.1.up", "layers.1.down", "layers.1.norm",
         "frozen", "unused", "norm_f"])
    assert cut.merged == []
    outer = nn.Linear(3, 3)
    model = nn.Sequential(outer, Shared(outer.weight))
    merged = plan_units(model, TransformerWrap(layer_classes=("Shared",))).merged
    assert len(merged) == 1 and merged[0].key == "wrapping" and "'1'" in merged[0].note


def test_launch_refuses_what_fsdp_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from zerobridge.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    started: list[Any] = []

    class FakeProc:
        def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
            started.append(env)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr("zerobridge.launch.subprocess.Popen", FakeProc)
    assert main(["run", "--nproc", "2", "--stage", "1", "--backend", "fsdp", str(script)]) == 2
    err = capsys.readouterr().err
    assert "sharding" in err and "ZeRO-1" in err and "--backend native" in err and "Traceback" not in err
    assert not started
    assert main(["run", "--nproc", "2", "--stage", "3", "--backend", "fsdp", str(script)]) == 0
    assert started[0]["ZEROBRIDGE_BACKEND"] == "fsdp" and "ZEROBRIDGE_ALLOW_APPROXIMATE" not in started[0]
    # --allow-approximate: launched with a warning; prepare in the workers reads the variable
    assert main(["run", "--nproc", "2", "--stage", "1", "--backend", "fsdp", "--allow-approximate", str(script)]) == 0
    assert started[1]["ZEROBRIDGE_ALLOW_APPROXIMATE"] == "1"
    assert "warning: --allow-approximate: fsdp runs sharding approximately" in capsys.readouterr().err


def test_allow_approximate_comes_from_the_argument_then_the_environment() -> None:
    from zerobridge.env import resolve_allow_approximate

    assert resolve_allow_approximate(None, env={}) is False
    assert resolve_allow_approximate(None, env={"ZEROBRIDGE_ALLOW_APPROXIMATE": "1"}) is True
    assert resolve_allow_approximate(False, env={"ZEROBRIDGE_ALLOW_APPROXIMATE": "1"}) is False
    with pytest.raises(ConfigError, match="not a yes/no value"):
        resolve_allow_approximate(None, env={"ZEROBRIDGE_ALLOW_APPROXIMATE": "maybe"})


# --------------------------------------------------------------------------- parity, world 2

@pytest.mark.distributed
@pytest.mark.parametrize("case", ["stage3", "stage3 optimizer after prepare", "shard_grad_op", "stage0",
                                  "every module", "activation checkpointing"])
def test_exact_specs_match_single_process(cluster: Cluster, case: str) -> None:
    table: dict[str, dict[str, Any]] = {
        "stage3": {"stage": 3},
        "stage3 optimizer after prepare": {"stage": 3, "optimizer_first": False},
        "shard_grad_op": {"spec": with_(STAGE3, sharding=ShardingSpec.for_stage(
            3, parameters="reshard_after_backward").model_dump(mode="json"))},
        "stage0": {"stage": 0},
        "every module": {"spec": with_(STAGE3, wrapping={"policy": "every_module"})},
        "activation checkpointing": {"spec": with_(STAGE3, checkpoint__activation_checkpointing=True)},
    }
    results = cluster.run(TRAIN, backend="fsdp", **table[case])
    assert_parity(results, reference())
    first: BackendRun = results[0]  # type: ignore[assignment]
    assert first.approximations == []
    recomputed = case == "activation checkpointing"
    assert first.forward_calls == 10 * (2 if recomputed else 1)
    if case == "stage0":  # the [world, 1] mesh: every rank holds every parameter whole
        assert [r.coordinate for r in results] == [(0, 0), (1, 0)]  # type: ignore[attr-defined]
        assert all(v.shape == first.state[k].shape for k, v in first.local.items())


@pytest.mark.distributed
def test_stage3_matches_native_and_counts_its_traffic(cluster: Cluster) -> None:
    fsdp, native = cluster.run(TRAIN, backend="fsdp", stage=3)[0], cluster.run(TRAIN, backend="native", stage=3)[0]
    assert isinstance(fsdp, BackendRun) and isinstance(native, RunResult)
    for a, b in zip(fsdp.losses, native.losses):
        assert rel(a, b) <= LOSS_RTOL
    net = ParityNet()
    total = 4 * sum(p.numel() for p in net.parameters())
    trained = total - 4 * sum(p.numel() for m in (net.frozen, net.unused) for p in m.parameters())
    stats, theirs = fsdp.stats[-1], native.stats[-1]
    assert set(stats) >= {"param_bytes", "grad_bytes", "optimizer_bytes", "tier_bytes", "comm_bytes", "comm_calls",
                          "loss_scale", "skipped_steps", "approximations"}
    # ZeRO-3 at N = 2: all-gather P in forward and again in backward, reduce-scatter the trained P,
    # each (N-1)/N of the buffer. FSDP2 pads every parameter to N rows: within 10%.
    expected = {"all_gather": 2 * total / 2, "reduce_scatter": trained / 2}
    for kind, value in expected.items():
        assert value <= stats["comm_bytes"][kind] <= 1.1 * value, (kind, stats["comm_bytes"], value)
        assert abs(stats["comm_bytes"][kind] - theirs["comm_bytes"][kind]) <= 0.1 * theirs["comm_bytes"][kind]
    assert stats["comm_calls"]["reduce_scatter"] == 3  # one per unit: the root and two layers
    assert total / 2 <= stats["param_bytes"] <= 1.1 * total / 2
    # AdamW's two moments of this rank's half of the trained parameters, and a 4-byte step per parameter
    assert trained <= stats["optimizer_bytes"] <= 1.1 * trained + 4 * len(list(net.parameters()))
    assert stats["tier_bytes"]["device"] == stats["param_bytes"] + stats["grad_bytes"] + stats["optimizer_bytes"]
    assert stats["loss_scale"] == 1.0 and stats["skipped_steps"] == 0


@pytest.mark.distributed
def test_what_fsdp2_cannot_express_is_refused_with_the_fix(cluster: Cluster) -> None:
    cpu, nvme = {"device": "cpu"}, {"device": "nvme", "nvme_path": "/tmp"}
    specs = {
        "stage1": spec_for_stage(1).model_dump(mode="json"),
        "stage2": spec_for_stage(2).model_dump(mode="json"),
        "params only": with_(STAGE3, offload=OffloadSpec.model_validate({"parameters": cpu}).model_dump(mode="json")),
        "optimizer only": with_(STAGE3, offload=OffloadSpec.model_validate({"optimizer": cpu}).model_dump(mode="json")),
        "nvme": with_(STAGE3, offload=OffloadSpec.model_validate({"optimizer": nvme, "parameters": nvme})
                      .model_dump(mode="json")),
    }
    messages = cluster.run(f"{RUN}:refusals", specs=specs)[0]
    assert isinstance(messages, dict)
    keys = {"stage1": "sharding: ", "stage2": "sharding: ", "params only": "offload.parameters.device: ",
            "optimizer only": "offload.optimizer.device: ", "nvme": "offload.optimizer.device: "}
    for name, key in keys.items():
        assert messages[name].startswith(key), messages[name]
        assert "allow_approximate=True" in messages[name] and "backend='native'" in messages[name]
    assert "ZeRO-1" in messages["stage1"] and "NVMe" in messages["nvme"]
    misuse = cluster.run(f"{RUN}:misuse")[0]
    assert isinstance(misuse, dict)
    assert "already prepared" in misuse["twice"] and "already stepped" in misuse["stepped"]


@pytest.mark.distributed
def test_every_rank_starts_from_rank0s_values(cluster: Cluster) -> None:
    """As on the native engine: ranks that built different weights train rank 0's."""
    expected = ParityNet(0).state_dict()
    for state in cluster.run(f"{RUN}:starts_from_rank0", backend="fsdp"):
        assert isinstance(state, dict) and state.keys() == expected.keys()
        assert all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.distributed
@pytest.mark.parametrize(("case", "key", "text"), [
    ("stage1", "sharding", "ZeRO-1"), ("stage2", "sharding", "ZeRO-2"),
    ("parameters offloaded alone", "offload.parameters.device", "gradients and the optimizer step move")])
def test_allow_approximate_runs_the_closest_form_and_records_it(cluster: Cluster, case: str, key: str,
                                                                text: str) -> None:
    table: dict[str, dict[str, Any]] = {
        "stage1": {"stage": 1}, "stage2": {"stage": 2},
        "parameters offloaded alone": {"spec": with_(STAGE3, offload=OffloadSpec.model_validate(
            {"parameters": {"device": "cpu", "pin_memory": False}}).model_dump(mode="json"))},
    }
    results = cluster.run(TRAIN, backend="fsdp", allow_approximate=True, **table[case])
    assert_parity(results, reference())  # the closest forms shard or offload more, with the same math
    recorded = results[0].approximations  # type: ignore[attr-defined]
    assert [a["key"] for a in recorded] == [key] and text in recorded[0]["note"]
    if key.startswith("offload"):
        assert results[0].stats[-1]["tier_bytes"]["device"] == 0  # type: ignore[attr-defined]


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "every_micro"), [(3, True), (3, False), (0, True)])
def test_accumulation_follows_the_native_rule(cluster: Cluster, stage: int, every_micro: bool) -> None:
    """Two micro-batches per step, gradients averaged over world x accumulation: stage 3 reduces
    every micro-batch (set aside between them), stage 0 only at the boundary; ``step_every_micro``
    steps and zeroes after every micro-batch, which must change nothing."""
    results = cluster.run(TRAIN, backend="fsdp", stage=stage, accumulation=2, step_every_micro=every_micro)
    assert_parity(results, reference(accumulation=2))
    calls = results[0].stats[-1]["comm_calls"]  # type: ignore[attr-defined]
    assert calls.get("reduce_scatter", 0) == (6 if stage == 3 else 0)  # 3 units x 2 micro-batches
    assert calls["all_reduce"] == 1  # stage 0: one gradient all-reduce; stage 3: the clip norm


@pytest.mark.distributed
def test_cpu_offload_of_both_tiers(cluster: Cluster) -> None:
    cpu = {"device": "cpu", "pin_memory": False}
    offload = OffloadSpec.model_validate({"optimizer": cpu, "parameters": cpu}).model_dump(mode="json")
    results = cluster.run(TRAIN, backend="fsdp", spec=with_(STAGE3, offload=offload))
    assert_parity(results, reference())
    tiers = results[0].stats[-1]["tier_bytes"]  # type: ignore[attr-defined]
    assert tiers["device"] == 0 and tiers["host"] > 0 and tiers["nvme"] == 0


@pytest.mark.distributed
def test_bf16_compute_with_fp32_master_weights(cluster: Cluster) -> None:
    spec = with_(STAGE3, precision=PrecisionSpec.model_validate({"param_dtype": "bf16"}).model_dump(mode="json"))
    fsdp, native = cluster.run(TRAIN, backend="fsdp", spec=spec)[0], cluster.run(TRAIN, backend="native", spec=spec)[0]
    assert isinstance(fsdp, BackendRun) and isinstance(native, RunResult)
    for a, b, c in zip(fsdp.losses, native.losses, reference(dtype="bf16").losses):
        assert rel(a, b) <= BF16_RTOL and rel(a, c) <= BF16_RTOL
    assert all(v.dtype == torch.float32 for v in fsdp.state.values())  # the master weights
    assert all(v.dtype == torch.float32 for v in fsdp.local.values())
    numel = sum(p.numel() for p in ParityNet().parameters())
    gathered = fsdp.stats[-1]["comm_bytes"]["all_gather"]  # bf16 (2 bytes), forward and backward, half each
    assert 2 * numel <= gathered <= 1.1 * 2 * numel


@pytest.mark.distributed
def test_fp16_loss_scaling_follows_the_native_scaler(cluster: Cluster) -> None:
    """An initial scale of 2^20 overflows: both backends skip the same steps and move the scale alike."""
    scaling = DynamicLossScale(initial_scale=2.0**20, growth_interval=3)
    precision = PrecisionSpec.model_validate({"param_dtype": "fp16", "loss_scaling": scaling}).model_dump(mode="json")
    spec = with_(STAGE3, precision=precision)
    fsdp, native = cluster.run(TRAIN, backend="fsdp", spec=spec)[0], cluster.run(TRAIN, backend="native", spec=spec)[0]
    assert isinstance(fsdp, BackendRun) and isinstance(native, RunResult)
    assert [s["loss_scale"] for s in fsdp.stats] == [s["loss_scale"] for s in native.stats]
    assert fsdp.stats[-1]["skipped_steps"] == native.stats[-1]["skipped_steps"] > 0
    for a, b in zip(fsdp.losses, native.losses):
        assert rel(a, b) <= 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize(("saver", "loader", "saved_at", "loaded_at"), [
    ("native", "fsdp", 3, 3), ("fsdp", "native", 3, 1), ("fsdp", "fsdp", 3, 0)])
def test_checkpoints_cross_backends(cluster: Cluster, tmp_path: Path, saver: str, loader: str, saved_at: int,
                                    loaded_at: int) -> None:
    path = str(tmp_path / "ckpt")
    ref = reference()
    saving = spec_for_stage(saved_at, ParityNet()).model_dump(mode="json")
    loading = spec_for_stage(loaded_at, ParityNet()).model_dump(mode="json")
    losses = cluster.run(f"{RUN}:save_after", backend=saver, spec=saving, path=path, steps=5)[0]
    assert isinstance(losses, list) and all(rel(a, b) <= LOSS_RTOL for a, b in zip(losses, ref.losses[:5]))
    resumed = cluster.run(f"{RUN}:resume", backend=loader, spec=loading, path=path, stop=10)
    for r in resumed:
        assert isinstance(r, dict) and r["metadata"] == {"step": 5} and r["lr"] == [3e-2, 3e-2]
        assert all(rel(a, b) <= LOSS_RTOL for a, b in zip(r["losses"], ref.losses[5:]))
        assert max((r["full"][k].float() - v).abs().max().item() for k, v in ref.state.items()) <= PARAM_ATOL


# --------------------------------------------------------------------------- hybrid, world 4


@pytest.mark.distributed
def test_hybrid_2x2_really_replicates(tmp_path: Path) -> None:
    spec = with_(STAGE3, sharding=ShardingSpec.for_stage(3, shard_group=2).model_dump(mode="json"))
    path = str(tmp_path / "hybrid")
    with Cluster(4, timeout_s=120) as four:
        results = four.run(TRAIN, backend="fsdp", spec=spec)
        four.run(f"{RUN}:save_after", backend="fsdp", spec=spec, path=path, steps=5)  # first replica writes
        resumed = four.run(f"{RUN}:resume", backend="native", spec=STAGE3.model_dump(mode="json"), path=path, stop=10)
    assert_parity(results, reference())
    runs = [r for r in results if isinstance(r, BackendRun)]
    assert [r.coordinate for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in ((0, 2), (1, 3)):  # the same shard in both replicas, bit for bit
        assert runs[a].local.keys() == runs[b].local.keys()
        assert all(torch.equal(runs[a].local[k], runs[b].local[k]) for k in runs[a].local)
    differ = [k for k in runs[0].local if runs[0].local[k].shape != runs[1].local[k].shape
              or not torch.equal(runs[0].local[k], runs[1].local[k])]
    assert len(differ) == len(runs[0].local)  # inside a replica, each rank holds other rows
    assert runs[0].stats[-1]["comm_calls"]["all_reduce"] == 4  # 3 units across replicas + the clip norm
    losses = resumed[0]["losses"]  # type: ignore[index]
    assert all(rel(a, b) <= LOSS_RTOL for a, b in zip(losses, reference().losses[5:]))
