"""``backend="deepspeed"``: the same spec and the same user loop on real DeepSpeed ZeRO.

One gloo group of two ranks. ParityNet (uneven sizes, a tied embedding/head,
a frozen layer, an unused parameter, two param groups) trains with
``zerobridge.testing.resume.train_steps``'s loop (``loss.backward()``,
``zerobridge.clip_grad_norm_``, ``optimizer.step()``, ``optimizer.zero_grad()``)
under the deepspeed backend and under the native engine, and is checked
against the single-process ``run_reference``: losses, the norms
``clip_grad_norm_`` returns, full state, stats, refusals, and checkpoints
crossing between the two backends. DeepSpeed steps the never-used
parameter with a zero gradient (AdamW's decoupled decay shrinks it) where
torch skips it, so ``unused.*`` is left out of parameter comparisons.

The worker functions below run on every rank (``Cluster.run`` imports this
module in the workers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

import zerobridge
from zerobridge.backends.base import backend_of
from zerobridge.backends.deepspeed.config import SCHEDULING
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster
from zerobridge.spec import DType, StrategySpec
from zerobridge.testing.deepspeed_run import BufferedParityNet
from zerobridge.testing.parity import ParityNet, batch, make_optimizer, run_reference
from zerobridge.testing.resume import train_steps

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.distributed

ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
STEPS, SAVED_AT = 10, 4
UNUSED = ("unused.weight", "unused.bias")
FP32_LOSS_RTOL = 1e-5
BF16_RTOL = 2**-7  # bf16's epsilon: rounding differences (DeepSpeed accumulates the tied weight's two
# gradients in bf16; after a stage-3 engine, DeepSpeed's own F.linear serves every model in the process)


# ---------------------------------------------------------------------- worker functions (every rank)

def _spec(stage: int, *, dtype: str = "fp32", accumulation: int = 1, offload: dict[str, Any] | None = None,
          spec_clip: float | None = None) -> StrategySpec:
    from zerobridge.spec.presets import spec_for_stage

    spec = spec_for_stage(stage, ParityNet(0))
    data = spec.dump()
    data["batch"].update(accumulation_steps=accumulation, clip_grad_norm=spec_clip)
    if dtype.startswith("bf16"):  # "bf16-fp32acc": gradients accumulated in fp32 (DeepSpeed's BF16_Optimizer)
        accumulate = DType.FP32 if dtype.endswith("fp32acc") else DType.BF16
        data["precision"].update(param_dtype=DType.BF16, reduce_dtype=DType.BF16, accumulate_dtype=accumulate)
    if offload:
        data["offload"].update(offload)
    return StrategySpec.model_validate(data)


def _prepare(seed: int, backend: str, *, buffered: bool = False,
             **prepare: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = BufferedParityNet(seed) if buffered else ParityNet(seed)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    return zerobridge.prepare(model, optimizer, backend=backend, **prepare)


def _accumulate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, accumulation: int, *,
                step_every_micro: bool, norms: list[float]) -> list[float]:
    """run_reference's accumulation: micro-batch ``m`` of each step split over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = 8 // accumulation
    mine = slice(rank * size // world, (rank + 1) * size // world)
    losses = []
    for step in range(steps):
        total = torch.zeros(1)
        for micro in range(accumulation):
            tokens, targets = batch(step, micro, size)
            loss = model(tokens[mine], targets[mine])
            loss.backward()  # undivided: the backend averages over ranks x accumulation steps
            total += loss.detach() / accumulation
            if step_every_micro and micro < accumulation - 1:
                optimizer.step()  # between boundaries: a no-op, as on the native engine
                optimizer.zero_grad()
        norms.append(zerobridge.clip_grad_norm_(model, 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def train(*, stage: int, backend: str = "deepspeed", dtype: str = "fp32", steps: int = STEPS,
          accumulation: int = 1, step_every_micro: bool = False, offload: dict[str, Any] | None = None,
          clip: float = 1.0, spec_clip: float | None = None) -> dict[str, Any]:
    """Train ParityNet; return losses, returned norms, full state, names, and one more step's stats."""
    spec = _spec(stage, dtype=dtype, accumulation=accumulation, offload=offload, spec_clip=spec_clip)
    model, optimizer = _prepare(0, backend, config=spec)
    norms: list[float] = []
    if accumulation == 1:
        losses = train_steps(model, optimizer, range(steps),
                             lambda m: norms.append(zerobridge.clip_grad_norm_(m, clip).item()))
    else:
        losses = _accumulate(model, optimizer, steps, accumulation, step_every_micro=step_every_micro, norms=norms)
    full = {k: v.detach().clone() for k, v in zerobridge.full_state_dict(model).items()}
    with torch.no_grad():  # a held-out loss, as run_native measures it
        rank, world = dist.get_rank(), dist.get_world_size()
        tokens, targets = batch(10_000, 0, 8)
        held_out = model(tokens[rank * 8 // world:(rank + 1) * 8 // world],
                         targets[rank * 8 // world:(rank + 1) * 8 // world]).float().reshape(1)
    dist.all_reduce(held_out)
    zerobridge.reset_stats(model)
    if accumulation == 1:  # one more step, measured alone
        train_steps(model, optimizer, range(steps, steps + 1), lambda m: zerobridge.clip_grad_norm_(m, clip))
    engine = getattr(model, "deepspeed_engine", None)
    return {"losses": losses, "norms": norms, "full": full, "stats": zerobridge.stats(model),
            "eval_loss": held_out.item() / dist.get_world_size(),
            "names": [n for n, _ in model.named_parameters(remove_duplicate=False)],
            "config": engine.config if engine is not None else None}


def save_run(*, path: str, backend: str, stage: int) -> dict[str, torch.Tensor]:
    """Train SAVED_AT steps and save; the full state at the save."""
    model, optimizer = _prepare(0, backend, stage=stage)
    train_steps(model, optimizer, range(SAVED_AT), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
    zerobridge.save_checkpoint(path, model, optimizer, metadata={"step": SAVED_AT, "by": backend})
    return zerobridge.full_state_dict(model)


def resume_run(*, path: str, backend: str, stage: int) -> dict[str, Any]:
    """Another seed and other hyperparameters, loaded from ``path``, trained to STEPS."""
    model, optimizer = _prepare(7, backend, stage=stage)
    for group in optimizer.param_groups:  # the checkpoint must put the saved values back
        group["lr"], group["weight_decay"] = 1.0, 0.5
    metadata = zerobridge.load_checkpoint(path, model, optimizer)
    loaded = zerobridge.full_state_dict(model)
    losses = train_steps(model, optimizer, range(SAVED_AT, STEPS), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
    return {"metadata": metadata, "loaded": loaded, "losses": losses}


def buffers(*, path: str, stage: int) -> dict[str, Any]:
    """Buffers (a float gain, an int64 forward counter, a non-persistent scratch) through
    full_state_dict and a save/load."""
    model, optimizer = _prepare(0, "deepspeed", buffered=True, stage=stage)
    train_steps(model, optimizer, range(3), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
    full = zerobridge.full_state_dict(model)
    zerobridge.save_checkpoint(path, model, optimizer)
    fresh, fresh_optimizer = _prepare(7, "deepspeed", buffered=True, stage=stage)
    zerobridge.load_checkpoint(path, fresh, fresh_optimizer)
    return {"full": full, "loaded": zerobridge.full_state_dict(fresh)}


def _error(call: Any) -> tuple[str | None, str, str | None] | None:
    try:
        call()
    except ConfigError as exc:
        return exc.key, exc.message, exc.fix
    return None


def refusals() -> dict[str, Any]:
    """What the backend refuses, and the approximation it runs when allowed."""
    hybrid = "fsdp-hybrid-shard-zero2"
    out: dict[str, Any] = {
        "hybrid": _error(lambda: _prepare(0, "deepspeed", strategy=hybrid)),
        "no_optimizer": _error(lambda: zerobridge.prepare(ParityNet(0), stage=2, backend="deepspeed")),
        "fp16": _error(lambda: _prepare(0, "deepspeed", config=_spec(1).model_copy(update={
            "precision": _spec(1).precision.model_copy(update={"param_dtype": DType.FP16})}))),
    }
    model, optimizer = _prepare(0, "deepspeed", strategy=hybrid, allow_approximate=True)
    out["allowed_losses"] = train_steps(model, optimizer, range(3), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
    out["allowed_stats"] = zerobridge.stats(model)
    out["report_keys"] = [e.key for e in backend_of(model).report.approximations]  # type: ignore[attr-defined]
    out["twice"] = _error(lambda: zerobridge.prepare(model, optimizer, stage=2, backend="deepspeed"))
    out["norm_type"] = _error(lambda: zerobridge.clip_grad_norm_(model, 1.0, norm_type=math.inf))
    out["state_dict"] = _error(optimizer.state_dict)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    train_steps(model, optimizer, range(3, 4), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
    scheduler.step()  # a torch LR scheduler drives the groups DeepSpeed steps
    out["scheduled_lr"] = [group["lr"] for group in optimizer.param_groups]
    try:
        zerobridge.clip_grad_norm_(model, 1.0)  # no backward since the last step
        out["clip_early"] = None
    except RuntimeError as exc:
        out["clip_early"] = str(exc)
    os.environ["ZEROBRIDGE_BACKEND"] = "deepspeed"  # a worker of this module's cluster: no one else reads it
    try:
        chosen, _ = _prepare(0, None, stage=1)  # type: ignore[arg-type]
    finally:
        del os.environ["ZEROBRIDGE_BACKEND"]
    out["env_backend"] = backend_of(chosen).name
    return out


# ---------------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=300, env=ENV) as made:  # the first run may JIT-build DeepSpeed's shm op
        yield made


_RUNS: dict[tuple[Any, ...], list[Any]] = {}


def runs(cluster: Cluster, target: str, **kwargs: Any) -> list[Any]:
    """``cluster.run`` of a worker here, each distinct call once per session."""
    key = (target, *sorted((k, repr(v)) for k, v in kwargs.items()))
    if key not in _RUNS:
        _RUNS[key] = cluster.run(f"test_backend_deepspeed:{target}", **kwargs)
    return _RUNS[key]


def relative(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], skip: tuple[str, ...] = UNUSED) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b if k not in skip)


# ---------------------------------------------------------------------- parity

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_matches_reference_and_native(cluster: Cluster, stage: int) -> None:
    ranks = runs(cluster, "train", stage=stage)
    ds, native = ranks[0], runs(cluster, "train", stage=stage, backend="native")[0]
    ref = run_reference(steps=STEPS)
    assert relative(ds["losses"], ref.losses) <= FP32_LOSS_RTOL
    # clip_grad_norm_ returns the global norm before clipping, the one the native engine returns.
    assert relative(ds["norms"], native["norms"]) <= FP32_LOSS_RTOL
    assert min(ds["norms"]) > 1.0  # the clipping bit every step, so the losses depend on it
    assert set(ds["full"]) == set(native["full"]) == set(ref.state)
    assert max_param_diff(ds["full"], native["full"]) <= 1e-5
    assert torch.equal(ds["full"]["head.weight"], ds["full"]["embed.weight"])
    assert max_param_diff(ranks[1]["full"], ds["full"], skip=()) == 0.0  # every rank holds the full state
    assert ds["names"] == native["names"] and not any(n.startswith("module.") for n in ds["names"])
    assert abs(ds["eval_loss"] - native["eval_loss"]) <= FP32_LOSS_RTOL * native["eval_loss"]  # under no_grad


@pytest.mark.parametrize(("stage", "dtype"), [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (1, "bf16-fp32acc")])
def test_bf16_with_fp32_masters_matches_native_bf16(cluster: Cluster, stage: int, dtype: str) -> None:
    ds = runs(cluster, "train", stage=stage, dtype=dtype)[0]
    native = runs(cluster, "train", stage=stage, backend="native", dtype=dtype)[0]
    assert relative(ds["losses"], native["losses"]) <= BF16_RTOL
    assert relative(ds["norms"], native["norms"]) <= BF16_RTOL
    trainable = [k for k in native["full"] if k not in UNUSED and not k.startswith("frozen.")]
    assert all(ds["full"][k].dtype == torch.float32 for k in trainable)  # fp32 masters, not the bf16 copies
    assert max_param_diff({k: ds["full"][k] for k in trainable}, {k: native["full"][k] for k in trainable}) <= BF16_RTOL


@pytest.mark.parametrize(("stage", "step_every_micro"), [(0, False), (0, True), (1, False), (2, True),
                                                         (3, False), (3, True)])
def test_accumulation_averages_over_ranks_and_micro_batches(cluster: Cluster, stage: int,
                                                            step_every_micro: bool) -> None:
    ds = runs(cluster, "train", stage=stage, steps=6, accumulation=2, step_every_micro=step_every_micro)[0]
    ref = run_reference(steps=6, accumulation=2)
    assert relative(ds["losses"], ref.losses) <= FP32_LOSS_RTOL
    assert relative(ds["norms"], ref.grad_norms) <= FP32_LOSS_RTOL


@pytest.mark.parametrize(("stage", "offload"), [(2, {"optimizer": {"device": "cpu"}}),
                                                (3, {"optimizer": {"device": "cpu"}, "parameters": {"device": "cpu"}})])
def test_cpu_offload_runs_the_users_optimizer(cluster: Cluster, stage: int, offload: dict[str, Any]) -> None:
    ds = runs(cluster, "train", stage=stage, steps=6, offload=offload)[0]
    assert relative(ds["losses"], run_reference(steps=6).losses) <= FP32_LOSS_RTOL
    assert ds["config"]["zero_force_ds_cpu_optimizer"] is False
    tiers = ds["stats"]["tier_bytes"]
    assert tiers["host"] >= ds["stats"]["optimizer_bytes"] > 0
    if "parameters" in offload:
        assert tiers["host"] >= ds["stats"]["optimizer_bytes"] + ds["stats"]["param_bytes"]


@pytest.mark.parametrize("stage", [0, 2])
def test_the_specs_clipping_applies_at_step_time(cluster: Cluster, stage: int) -> None:
    # No clipping by the loop: batch.clip_grad_norm=1.0 (DeepSpeed's gradient_clipping) does it.
    ds = runs(cluster, "train", stage=stage, steps=6, clip=math.inf, spec_clip=1.0)[0]
    ref = run_reference(steps=6, clip=1.0)
    assert relative(ds["losses"], ref.losses) <= FP32_LOSS_RTOL
    assert ds["config"]["gradient_clipping"] == 1.0


# ---------------------------------------------------------------------- stats

def test_stats_count_deepspeeds_collectives_and_memory(cluster: Cluster) -> None:
    stats = {stage: runs(cluster, "train", stage=stage)[0]["stats"] for stage in range(4)}
    native = {stage: runs(cluster, "train", stage=stage, backend="native")[0]["stats"] for stage in range(4)}
    for stage in range(4):
        assert set(native[stage]) <= set(stats[stage])
        # Stage 3 gathers per submodule where the spec cuts per layer: recorded, not refused.
        assert {entry["key"] for entry in stats[stage]["approximations"]} <= SCHEDULING
        assert stats[stage]["loss_scale"] == 1.0 and stats[stage]["skipped_steps"] == 0
        ds_bytes, native_bytes = sum(stats[stage]["comm_bytes"].values()), sum(native[stage]["comm_bytes"].values())
        assert 0.5 * native_bytes <= ds_bytes <= 4 * native_bytes, (stage, stats[stage]["comm_bytes"])
    # Stage 0: one bucket all-reduce per step; the loop's own loss all-reduce is not DeepSpeed's.
    assert stats[0]["comm_calls"] == {"all_reduce": 1}
    assert stats[2]["comm_calls"].get("all_gather", 0) >= 1  # updated partitions
    assert stats[3]["comm_calls"].get("reduce_scatter", 0) >= 1
    # What ZeRO shards, this rank holds half of.
    assert stats[1]["optimizer_bytes"] < 0.8 * stats[0]["optimizer_bytes"]
    assert stats[3]["param_bytes"] < 0.6 * stats[0]["param_bytes"]
    assert stats[0]["param_bytes"] == native[0]["param_bytes"]


# ---------------------------------------------------------------------- refusals

def test_refusals_name_the_key_and_the_fix(cluster: Cluster) -> None:
    out = runs(cluster, "refusals")[0]
    key, message, fix = out["hybrid"]  # SHARD_GRAD_OP timing and a hybrid group: both named
    assert key == "sharding.parameters" and "sharding.shard_group" in message and "allow_approximate=True" in fix
    assert "backend='native'" in fix
    assert out["no_optimizer"][0] == "optimizer" and "zerobridge.prepare(model, optimizer" in out["no_optimizer"][2]
    assert out["fp16"][0] == "precision.param_dtype" and "bf16" in out["fp16"][2]
    assert out["twice"][0] == "model"
    assert out["norm_type"][0] == "norm_type"
    assert "save_checkpoint" in out["state_dict"][2]
    assert out["clip_early"] is not None and "after backward" in out["clip_early"]
    assert out["env_backend"] == "deepspeed"
    assert out["scheduled_lr"] == [3e-2 * 0.5, 3e-2 * 0.5]


def test_allow_approximate_runs_the_closest_and_records_it(cluster: Cluster) -> None:
    out = runs(cluster, "refusals")[0]
    # _HYBRID_SHARD_ZERO2 runs as ZeRO-2 over the whole world: the same math.
    assert relative(out["allowed_losses"], run_reference(steps=3).losses) <= FP32_LOSS_RTOL
    recorded = {entry["key"] for entry in out["allowed_stats"]["approximations"]}
    assert {"sharding.parameters", "sharding.shard_group"} <= recorded <= set(out["report_keys"])


# ---------------------------------------------------------------------- checkpoints

def test_native_checkpoint_continues_on_deepspeed(cluster: Cluster, tmp_path: Path) -> None:
    path = str(tmp_path / "native")
    runs(cluster, "save_run", path=path, backend="native", stage=1)
    ref = run_reference(steps=STEPS).losses[SAVED_AT:]
    for stage in (2, 3):
        out = runs(cluster, "resume_run", path=path, backend="deepspeed", stage=stage)[0]
        assert out["metadata"] == {"step": SAVED_AT, "by": "native"}
        assert relative(out["losses"], ref) <= FP32_LOSS_RTOL, stage


def test_deepspeed_checkpoint_continues_on_native_and_deepspeed(cluster: Cluster, tmp_path: Path) -> None:
    from zerobridge.checkpoint.metadata import LAYOUT_KEY
    from zerobridge.checkpoint.portable import read_portable
    from zerobridge.checkpoint.reader import open_checkpoint

    path = str(tmp_path / "deepspeed")
    saved = runs(cluster, "save_run", path=path, backend="deepspeed", stage=3)[0]
    layout = open_checkpoint(path).read_bytes([LAYOUT_KEY])[LAYOUT_KEY]  # what `checkpoint info` shows
    assert layout["world_size"] == 2 and "ZeRO stage 3" in layout["strategy"]
    state = read_portable(path)
    assert max_param_diff(state.model, saved, skip=()) == 0.0  # the full fp32 masters, bit for bit
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state.optimizer["embed.weight"])
    assert state.optimizer["embed.weight"]["step"].item() == SAVED_AT
    ref = run_reference(steps=STEPS).losses[SAVED_AT:]
    for backend, stage in (("native", 2), ("deepspeed", 1), ("deepspeed", 0)):
        out = runs(cluster, "resume_run", path=path, backend=backend, stage=stage)[0]
        assert out["metadata"] == {"step": SAVED_AT, "by": "deepspeed"}
        assert max_param_diff(out["loaded"], saved) == 0.0, (backend, stage)
        assert relative(out["losses"], ref) <= FP32_LOSS_RTOL, (backend, stage)


def test_buffers_in_full_state_and_checkpoints(cluster: Cluster, tmp_path: Path) -> None:
    out = runs(cluster, "buffers", path=str(tmp_path / "buffers"), stage=3)[0]
    full, loaded = out["full"], out["loaded"]
    assert "scratch" not in full and full["calls"].dtype == torch.int64 and full["calls"].item() == 3
    assert torch.equal(full["gain"], BufferedParityNet(0).gain)
    assert set(loaded) == set(full) and max_param_diff(loaded, full, skip=()) == 0.0


# ---------------------------------------------------------------------- launcher

def test_launcher_refuses_what_deepspeed_cannot_run(tmp_path: Path) -> None:
    import argparse

    from zerobridge.launch import add_run_arguments, validate

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    with pytest.raises(ConfigError) as caught:
        validate(parser.parse_args(["--nproc", "2", "--strategy", "fsdp-hybrid-shard-zero2", "--backend",
                                    "deepspeed", str(script)]))
    assert caught.value.key == "sharding.parameters" and "sharding.shard_group" in caught.value.message
    assert "--allow-approximate" in (caught.value.fix or "")
    validate(parser.parse_args(["--nproc", "2", "--strategy", "zero3-offload", "--backend", "deepspeed", str(script)]))
    validate(parser.parse_args(["--nproc", "2", "--strategy", "fsdp-hybrid-shard-zero2", "--backend", "deepspeed",
                                "--allow-approximate", str(script)]))
