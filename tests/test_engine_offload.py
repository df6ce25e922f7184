"""Offload tiers of the native engine: results unchanged, bytes where the spec says.

Every parity case trains ``ParityNet`` (tied weight, frozen and unused layers,
uneven sizes) for 10 steps with the optimizer and/or parameter tier on nvme
(or cpu) and compares losses, grad norms, a held-out loss and the final full
parameters with the same spec without offload (1e-6; measured: bitwise
equal). One 2-rank process group serves the module; the worker functions
below run on its ranks (the workers import this module by name); one hybrid
case starts its own 4 ranks. Swap files go to a fresh directory per module.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerobridge.engine.nvme_step import tiles
from zerobridge.engine.plan import check_runnable, plan_engine
from zerobridge.engine.swapfile import PREFIX, SwapSpace, remove_stale
from zerobridge.engine.tiers import check_offload
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster
from zerobridge.spec import (
    BatchSpec,
    CommunicationSpec,
    DynamicLossScale,
    EveryModuleWrap,
    OffloadSpec,
    PrecisionSpec,
    ShardingSpec,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.testing.parity import ParityNet, RunResult

NATIVE = "zerobridge.testing.parity:run_native"
HERE = "test_engine_offload"
ROOT = Path(__file__).resolve().parents[1]
TIGHT = 1e-6


def with_offload(spec: StrategySpec, root: Path | None, *, optimizer: str = "none", parameters: str = "none",
                 **fields: Any) -> StrategySpec:
    """``spec`` with the tiers set; nvme tiers put their files under ``root``."""
    tiers: dict[str, Any] = {"optimizer": {"device": optimizer}, "parameters": {"device": parameters}}
    for name, device in (("optimizer", optimizer), ("parameters", parameters)):
        if device == "nvme":
            tiers[name]["nvme_path"] = str(root)
    tiers["optimizer"].update(fields.pop("optimizer_fields", {}))
    return spec.model_copy(update={"offload": OffloadSpec.model_validate({**tiers, **fields})})


def stage(n: int, **fields: Any) -> StrategySpec:
    wrap = {"wrapping": TransformerWrap()} if n == 3 else {}
    return StrategySpec(sharding=ShardingSpec.for_stage(n), **{**wrap, **fields})


BF16 = PrecisionSpec(param_dtype="bf16", master_dtype="fp32")

# name: (base spec, optimizer tier, parameter tier, extra offload fields, run_native kwargs)
CASES: dict[str, tuple[StrategySpec, str, str, dict[str, Any], dict[str, Any]]] = {
    "optimizer nvme, stage 1": (stage(1), "nvme", "none", {}, {}),
    "optimizer nvme, stage 2, tiles of 64": (stage(2), "nvme", "none", {"sub_group_size": 64}, {}),
    "optimizer nvme, stage 3, tiles of 64": (stage(3), "nvme", "none", {"sub_group_size": 64}, {}),
    "parameters nvme, stage 3": (stage(3), "none", "nvme", {}, {}),
    "both nvme, stage 3, one tile per parameter": (stage(3), "nvme", "nvme", {"sub_group_size": 0}, {}),
    "both nvme, stage 3, every module a unit, SGD": (
        stage(3, wrapping=EveryModuleWrap()), "nvme", "nvme", {"sub_group_size": 100}, {"optimizer": "sgd"}),
    "both nvme, pipelined reads and writes": (
        stage(3), "nvme", "nvme", {"sub_group_size": 50, "optimizer_fields": {
            "pipeline_read": True, "pipeline_write": True}}, {}),
    "both nvme, bf16 with fp32 master": (stage(3, precision=BF16), "nvme", "nvme", {"sub_group_size": 64}, {}),
    "optimizer nvme, stage 2, bf16 with fp32 master": (stage(2, precision=BF16), "nvme", "none", {}, {}),
    "both nvme, hpZ groups of 1, persistent small parameters": (
        StrategySpec(sharding=ShardingSpec.for_stage(3, backward_gather_group=1), wrapping=TransformerWrap(),
                     communication=CommunicationSpec(persistence_threshold=30)), "nvme", "nvme",
        {"sub_group_size": 64}, {}),
    "both nvme, spec clipping 0.05": (stage(3, batch=BatchSpec(clip_grad_norm=0.05)), "nvme", "nvme", {}, {}),
    "optimizer nvme, fp16 loss scale skipping overflows": (
        stage(2, precision=PrecisionSpec(param_dtype="fp16", master_dtype="fp32", reduce_dtype="fp32",
                                         loss_scaling=DynamicLossScale(initial_scale=2.0**20, hysteresis=1))),
        "nvme", "none", {}, {"optimizer": "sgd", "steps": 12}),
    "accumulation (DeepSpeed), optimizer nvme, stage 2": (
        stage(2), "nvme", "none", {"sub_group_size": 64}, {"accumulation": 2, "optimizer": "sgd"}),
    "accumulation (no_sync), both nvme, stage 3": (
        stage(3), "nvme", "nvme", {}, {"accumulation": 2, "accumulation_mode": "no_sync"}),
    "cpu tiers, stage 3": (stage(3), "cpu", "cpu", {}, {}),
    "optimizer cpu, stage 2, bf16": (stage(2, precision=BF16), "cpu", "none", {}, {}),
}


@pytest.fixture(scope="module")
def nvme(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def pair() -> Iterator[Cluster]:
    with Cluster(2, timeout_s=180) as cluster:
        yield cluster


def close(a: float, b: float, tol: float) -> bool:
    return a == b or abs(a - b) <= tol * abs(b) or (math.isnan(a) and math.isnan(b))  # inf, nan: skipped fp16 steps


def assert_same_run(got: RunResult, ref: RunResult, tol: float = TIGHT) -> None:
    assert len(got.losses) == len(ref.losses) >= 10
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert close(a, b, tol), f"loss at step {step}: {a} vs {b} without offload"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert close(a, b, tol), f"grad norm at step {step}: {a} vs {b}"
    assert abs(got.eval_loss - ref.eval_loss) <= tol * abs(ref.eval_loss)
    assert set(got.state) == set(ref.state)
    for name, value in ref.state.items():
        assert got.state[name].dtype == value.dtype, name
        assert (got.state[name] - value).abs().max().item() <= tol, name


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_offload_changes_no_number(pair: Cluster, nvme: Path, name: str) -> None:
    base, optimizer, parameters, fields, kwargs = CASES[name]
    offloaded = with_offload(base, nvme, optimizer=optimizer, parameters=parameters, **fields)
    ref: Any = pair.run(NATIVE, spec=base, **kwargs)
    got: Any = pair.run(NATIVE, spec=offloaded, **kwargs)
    assert_same_run(got[0], ref[0])
    assert got[0].losses == got[1].losses
    tiers = [r.stats[-1]["tier_bytes"] for r in got]
    if "nvme" in (optimizer, parameters):  # the run did offload: parity is not vacuous
        assert all(t["nvme"] > 0 for t in tiers), tiers
    else:
        assert all(t["host"] > 0 and t["nvme"] == 0 for t in tiers), tiers
    if "fp16" in name:
        assert got[0].stats[-1]["skipped_steps"] >= 1, "the case must exercise a skipped step"


@pytest.mark.distributed
def test_hybrid_sharding_with_both_tiers_on_nvme(nvme: Path) -> None:
    """Four ranks, shard groups of 2: each replica streams its own copy of the state."""
    base = StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2), wrapping=TransformerWrap())
    with Cluster(4, timeout_s=180) as quad:
        ref: Any = quad.run(NATIVE, spec=base)
        got: Any = quad.run(NATIVE, spec=with_offload(base, nvme, optimizer="nvme", parameters="nvme",
                                                      sub_group_size=64))
    assert_same_run(got[0], ref[0])
    assert all(r.stats[-1]["tier_bytes"]["nvme"] > 0 for r in got)


def test_world_of_one_both_nvme(nvme: Path) -> None:
    """One rank: the shard is the whole group, read in from the file and let go again."""
    from zerobridge.testing.parity import run_native

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ref = run_native(spec=stage(3, precision=BF16))
        got = run_native(spec=with_offload(stage(3, precision=BF16), nvme, optimizer="nvme", parameters="nvme",
                                           sub_group_size=64))
    finally:
        dist.destroy_process_group()
    assert_same_run(got, ref)
    assert got.stats[-1]["param_bytes"] == 0, "every parameter of a one-unit-per-layer model lives in the file"


# ----------------------------------------------------------------------------- bytes by tier


def memory_by_tier(*, spec: StrategySpec, steps: int = 2) -> dict[str, Any]:
    """Worker: train ``Wide`` with AdamW; bytes by tier at rest and live tensor bytes."""
    import zerobridge
    from zerobridge.testing.measure import Wide, live_tensor_bytes

    baseline = live_tensor_bytes()
    model = Wide()
    params = sum(p.numel() for p in model.parameters())
    model = zerobridge.prepare(model, config=spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = torch.randn(8, 61, generator=torch.Generator().manual_seed(step + 100 * dist.get_rank()))
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = zerobridge.stats(model)
    padded = sum(g.layout.shard_numel for g in model.zerobridge_engine.trainable)  # type: ignore[attr-defined]
    tensors = sum(1 for _ in model.parameters())
    return {"params": params, "padded": padded, "tensors": tensors, "stats": stats,
            "live": live_tensor_bytes() - baseline}


@pytest.mark.distributed
@pytest.mark.parametrize(("optimizer", "parameters", "dtype"), [
    ("nvme", "none", "fp32"), ("nvme", "none", "bf16"), ("none", "nvme", "fp32"), ("nvme", "nvme", "bf16"),
    ("cpu", "cpu", "fp32"),
])
def test_tier_bytes_follow_the_formula(pair: Cluster, nvme: Path, optimizer: str, parameters: str,
                                       dtype: str) -> None:
    base = StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=EveryModuleWrap(),
                        precision=BF16 if dtype == "bf16" else PrecisionSpec())
    plain: Any = pair.run(f"{HERE}:memory_by_tier", spec=base)
    got: Any = pair.run(f"{HERE}:memory_by_tier", spec=with_offload(base, nvme, optimizer=optimizer,
                                                                   parameters=parameters))
    p, tensors = got[0]["params"], got[0]["tensors"]
    padded = sum(r["padded"] for r in got)  # P plus padding, over both ranks
    assert p <= padded < p + 2 * 8  # under N elements of padding per group
    compute = 2 if dtype == "bf16" else 4
    # Summed over the two ranks (each parameter element belongs to exactly one rank's
    # run): AdamW moments 8 bytes per parameter, its `step` 4 bytes per tensor and
    # rank; a separate master 4 bytes per padded element; compute shards and the
    # gradient store `compute` bytes per padded element. On this CPU machine the cpu
    # tiers copy nothing (no separate master); the bytes count as host.
    where = {"none": "device", "cpu": "host", "nvme": "nvme"}
    expected = {"device": 0, "host": 0, "nvme": 0}
    expected[where[optimizer]] += 8 * p
    expected["device" if optimizer == "none" else "host"] += 4 * tensors * 2
    if dtype == "bf16" or parameters == "nvme":
        expected[where[optimizer]] += 4 * padded
    expected[where[parameters]] += compute * padded
    expected["device"] += compute * padded
    total = {tier: sum(r["stats"]["tier_bytes"][tier] for r in got) for tier in expected}
    assert total == expected, (total, expected)
    # From outside the engine: a scan of live tensors sees exactly the resident bytes,
    # and an nvme optimizer tier takes the moments out of memory.
    for before, after in zip(plain, got):
        stats = after["stats"]
        resident = stats["param_bytes"] + stats["grad_bytes"] + stats["optimizer_bytes"]
        assert resident == stats["tier_bytes"]["device"] + stats["tier_bytes"]["host"]
        assert abs(after["live"] - resident) <= 0.02 * resident + 4096, (after["live"], resident)
        if optimizer == "nvme":
            assert before["live"] - after["live"] >= 0.95 * 8 * p / 2


# ----------------------------------------------------------------------------- what is in memory during a step


class ProbeAdamW(torch.optim.AdamW):
    """AdamW that records, at each call of its step, the bytes of state tensors it
    holds, and the bytes of every tensor alive in the process (a ``gc`` scan)."""

    calls: list[int]
    live: list[int]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        from zerobridge.testing.measure import live_tensor_bytes

        held = 0
        for state in self.state.values():
            held += sum(v.numel() * v.element_size() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.numel() > 1)
        self.calls.append(held)
        self.live.append(live_tensor_bytes())
        return super().step(closure)


def probe_step_memory(*, spec: StrategySpec, steps: int = 3, probe: bool = True) -> dict[str, Any]:
    """Worker: ParityNet with ``ProbeAdamW`` (else plain AdamW); what the optimizer
    held at each call."""
    import zerobridge
    from zerobridge.testing.parity import batch, param_groups

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # hooks AdamW.step too: ProbeAdamW's step nests
    model = zerobridge.prepare(ParityNet(0), config=spec)
    kind = ProbeAdamW if probe else torch.optim.AdamW
    optimizer = kind(param_groups(list(model.named_parameters()), 0.1), lr=1e-2)
    optimizer.calls, optimizer.live = [], []  # type: ignore[attr-defined]
    per_step, live, losses = [], [], []
    engine = model.zerobridge_engine  # type: ignore[attr-defined]
    for step in range(steps):
        tokens, targets = batch(step, 0, 8)
        mine = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
        loss = model(tokens[mine], targets[mine])
        loss.backward()
        losses.append(loss.item())
        before = len(optimizer.calls)  # type: ignore[attr-defined]
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(optimizer.calls[before:])  # type: ignore[attr-defined]
        live.append(optimizer.live[before:])  # type: ignore[attr-defined]
    swapper = engine.stepper.swapper
    stepped = [[(g, i) for g, i in tile if g.refs[i].names[0] != "unused.weight" and g.refs[i].names[0] !=
                "unused.bias"] for tile in (swapper.tiles if swapper else [])]
    at_rest = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.numel() > 1)
    swap_files = sorted(str(p) for p in (swapper.space.path.iterdir() if swapper else []))
    return {"per_step": per_step, "live": live, "losses": losses, "at_rest": at_rest, "swap_files": swap_files,
            "tile_numels": [sum(g.layout.pieces[i].numel for g, i in tile) for tile in stepped if tile],
            "peak": swapper.peak_bytes if swapper else None,
            "local_numel": sum(p.numel() for p in model.parameters() if p.requires_grad)}


@pytest.mark.distributed
@pytest.mark.parametrize("stage_n", [2, 3])
def test_only_one_tile_of_state_is_in_memory_during_the_step(pair: Cluster, nvme: Path, stage_n: int) -> None:
    """Also: an optimizer subclass whose step calls ``super().step()`` (torch then runs
    the step hooks twice, nested) trains exactly as without offload."""
    base = stage(stage_n)
    reference: Any = pair.run(f"{HERE}:probe_step_memory", spec=base, probe=False)  # no subclass, no nesting
    plain: Any = pair.run(f"{HERE}:probe_step_memory", spec=base)
    got: Any = pair.run(f"{HERE}:probe_step_memory", spec=with_offload(base, nvme, optimizer="nvme",
                                                                       sub_group_size=64))
    for ref, before, after in zip(reference, plain, got):
        assert after["losses"] == before["losses"] == ref["losses"]
        tiles_run = len(after["tile_numels"])
        largest = 8 * max(after["tile_numels"])  # AdamW: two fp32 moments per element
        assert tiles_run >= 4, "small tiles: the step must stream"
        for calls, live in zip(after["per_step"][1:], after["live"][1:]):  # from the second step all have state
            assert len(calls) == tiles_run + 1, "one optimizer call per tile, plus the user's own"
            assert max(calls) <= largest, (calls, largest)
            assert calls[-1] == 0, "the user's step sees no engine state in memory"
            # Outside the optimizer too: during a tile's step the process holds no more
            # tensor bytes than at the user's own call (no engine state) plus one tile.
            extra = [n - live[-1] for n in live[:-1]]
            assert max(extra) <= largest + 4 * 16, (extra, largest)
        assert 0 < after["peak"] <= largest + 4 * 16, "the engine's own count, plus `step` scalars"
        assert after["at_rest"] == 0, "between steps the optimizer holds no engine state tensors"
        assert after["swap_files"], "state lives in a swap file"
        # Without offload the optimizer holds the whole state at once: the test can tell.
        assert max(before["per_step"][-1]) > 2 * largest
        assert before["at_rest"] >= 8 * before["local_numel"] - 8 * 8


# ----------------------------------------------------------------------------- files


def swap_dirs_lifecycle(*, spec: StrategySpec) -> dict[str, Any]:
    """Worker: the engine's swap directories exist while it trains and vanish with it."""
    import zerobridge
    from zerobridge.testing.parity import batch, make_optimizer

    model = zerobridge.prepare(ParityNet(0), config=spec)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    tokens, targets = batch(0, 0, 4)
    model(tokens, targets).backward()
    optimizer.step()
    spaces = [s for s in model.zerobridge_engine.spaces if s is not None]  # type: ignore[attr-defined]
    paths = [s.path for s in spaces]
    during = {str(p): sorted((f.name, f.stat().st_size) for f in p.iterdir()) for p in paths}
    del model, optimizer, spaces
    gc.collect()
    return {"during": during, "after": [p.exists() for p in paths]}


@pytest.mark.distributed
def test_swap_files_exist_while_training_and_go_with_the_engine(pair: Cluster, nvme: Path) -> None:
    spec = with_offload(stage(3), nvme, optimizer="nvme", parameters="nvme")
    results: Any = pair.run(f"{HERE}:swap_dirs_lifecycle", spec=spec)
    for rank, result in enumerate(results):
        assert len(result["during"]) == 2, "one directory per nvme tier"
        for path, files in result["during"].items():
            assert Path(path).parent == nvme and f"-r{rank}-" in Path(path).name
            assert files and all(size > 0 for _, size in files), files
        assert result["after"] == [False, False], "removed once the engine is garbage collected"


def test_swap_files_are_removed_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch, zerobridge
        from zerobridge.spec import OffloadSpec, ShardingSpec, StrategySpec
        spec = StrategySpec(sharding=ShardingSpec.for_stage(3), offload=OffloadSpec.model_validate(
            {{"optimizer": {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}}}))
        model = zerobridge.prepare(torch.nn.Linear(8, 8), config=spec)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        print(model.zerobridge_engine.spaces.optimizer.path)
        globals()["keep"] = (model, optimizer)   # alive until the interpreter exits
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path and path.name.startswith(PREFIX)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_stale_swap_directories_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    space = SwapSpace(tmp_path, rank=0, label="optimizer")  # a live one: this process
    stale = tmp_path / space.path.name.replace(f"-{os.getpid()}-", f"-{pid}-")
    stale.mkdir()
    (stale / "optimizer.swp").write_bytes(b"x" * 100)
    other_host = tmp_path / f"{PREFIX}optimizer-elsewhere-{pid}-r0-00000000"
    other_host.mkdir()
    assert remove_stale(tmp_path) == [stale]
    assert not stale.exists() and space.path.exists() and other_host.exists()
    space.close()
    assert not space.path.exists()


def test_file_regions_round_trip_any_dtype(tmp_path: Path) -> None:
    space = SwapSpace(tmp_path, rank=3, label="parameters")
    values = {dtype: torch.randn(1000).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    regions = {dtype: space.allocate(1000, dtype) for dtype in values}
    for dtype, region in regions.items():
        region.write(0, values[dtype][:600])
        region.write(600, values[dtype][600:])
    for dtype, region in regions.items():
        assert torch.equal(region.read(0, torch.empty(1000, dtype=dtype)), values[dtype])
        assert torch.equal(region.read(250, torch.empty(10, dtype=dtype)), values[dtype][250:260])
    assert space.used_bytes == 1000 * (4 + 2 + 2)
    try:  # (not pytest.raises: its record of the traceback would keep the space alive)
        regions[torch.float32].read(995, torch.empty(10))
        raise AssertionError("a read past the region's end must raise")
    except IndexError:
        pass
    del space, regions, region
    gc.collect()
    assert not list(tmp_path.iterdir()), "garbage collection removes the directory"


def test_tiles_bound_elements() -> None:
    assert tiles([5, 3, 12, 2, 2], cap=8) == [[0, 1], [2], [3, 4]]
    assert tiles([4, 4], cap=0) == [[0], [1]]
    assert tiles([1, 2, 3], cap=10**9) == [[0, 1, 2]]


# ----------------------------------------------------------------------------- refusals


def nvme_spec(stage_n: int, path: str, *, tier: str = "optimizer") -> StrategySpec:
    return with_offload(stage(stage_n), Path(path), **{tier: "nvme"})  # type: ignore[arg-type]


def unwritable(tmp_path: Path) -> str:
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses new files
        return "/sys"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked)


@pytest.mark.parametrize("tier", ["optimizer", "parameters"])
def test_missing_or_unwritable_path_is_a_config_error(tmp_path: Path, tier: str) -> None:
    key = f"offload.{tier}.nvme_path"
    (tmp_path / "a_file").write_text("")
    for path, words in ((str(tmp_path / "missing"), "does not exist"), (unwritable(tmp_path), "not writable"),
                        (str(tmp_path / "a_file"), "not a directory")):
        spec = nvme_spec(3, path, tier=tier)
        with pytest.raises(ConfigError) as caught:
            plan_engine(spec, ParityNet(), world_size=2, local_world_size=2)
        assert caught.value.key == key and words in caught.value.message and caught.value.fix
        with pytest.raises(ConfigError):
            check_runnable(spec, world_size=2)


def test_prepare_refuses_a_missing_or_unwritable_path(tmp_path: Path, solo_group: None) -> None:
    import zerobridge

    with pytest.raises(ConfigError, match="does not exist") as caught:
        zerobridge.prepare(ParityNet(), config=nvme_spec(2, str(tmp_path / "nope")))
    assert caught.value.key == "offload.optimizer.nvme_path" and "mkdir" in (caught.value.fix or "")
    with pytest.raises(ConfigError, match="not writable") as caught:
        zerobridge.prepare(ParityNet(), config=nvme_spec(3, unwritable(tmp_path), tier="parameters"))
    assert caught.value.key == "offload.parameters.nvme_path" and "permissions" in (caught.value.fix or "")


def test_run_refuses_a_missing_path_before_launching(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "zerobridge.cli", "run", "--nproc", "2", "--strategy", "zero-infinity",
           str(ROOT / "examples" / "train_gpt.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "offload.optimizer.nvme_path" in done.stderr and "fix:" in done.stderr
    assert "Traceback" not in done.stderr


def test_unsupported_offload_settings_are_refused(tmp_path: Path) -> None:
    partial = with_offload(stage(3), tmp_path, optimizer="cpu", optimizer_fields={"ratio": 0.5})
    with pytest.raises(ConfigError) as caught:
        plan_engine(partial, ParityNet(), world_size=2, local_world_size=2)
    assert caught.value.key == "offload.optimizer.ratio" and "1.0" in (caught.value.fix or "")
    # Parameters replicated at rest (the spec's own validator says so too).
    with pytest.raises(ConfigError) as caught:
        check_offload(OffloadSpec.model_validate({"parameters": {"device": "cpu"}}), sharded_at_rest=False)
    assert caught.value.key == "offload.parameters.device" and "stage 3" in (caught.value.fix or "")


# ----------------------------------------------------------------------------- checkpoint access


def access_round_trip(*, spec: StrategySpec, steps: int = 3) -> dict[str, Any]:
    """Worker: read master and optimizer state of a trained engine run by run,
    write them into a fresh engine whose optimizer never stepped, and train both on."""
    import zerobridge
    from zerobridge.engine import local_runs as access
    from zerobridge.testing.parity import batch, make_optimizer

    def train(model: Any, optimizer: Any, start: int, count: int) -> list[float]:
        losses = []
        rank = dist.get_rank()
        for step in range(start, start + count):
            tokens, targets = batch(step, 0, 8)
            loss = model(tokens[rank * 4:rank * 4 + 4], targets[rank * 4:rank * 4 + 4])
            loss.backward()
            zerobridge.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    a = zerobridge.prepare(ParityNet(0), config=spec)
    opt_a = make_optimizer(list(a.named_parameters()), "adamw")
    train(a, opt_a, 0, steps)
    engine_a = a.zerobridge_engine  # type: ignore[attr-defined]
    saved = {}
    for run in access.local_runs(engine_a):
        state = access.read_optimizer_state(engine_a, opt_a, run)
        saved[run.names[0]] = (access.read_master(engine_a, run).clone(),
                               {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    b = zerobridge.prepare(ParityNet(1), config=spec)  # other initial values, overwritten below
    opt_b = make_optimizer(list(b.named_parameters()), "adamw")
    engine_b = b.zerobridge_engine  # type: ignore[attr-defined]
    for run in access.local_runs(engine_b):
        values, state = saved[run.names[0]]
        access.write_master(engine_b, run, values)
        if state:
            access.write_optimizer_state(engine_b, opt_b, run, state)
    access.refresh_compute(engine_b)
    in_memory = sum(v.numel() for s in opt_b.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1)
    read_back = all(torch.equal(access.read_optimizer_state(engine_b, opt_b, run)[k], v)
                    for run in access.local_runs(engine_b) for k, v in saved[run.names[0]][1].items()
                    if isinstance(v, torch.Tensor))
    la, lb = train(a, opt_a, steps, steps), train(b, opt_b, steps, steps)
    sa, sb = zerobridge.full_state_dict(a), zerobridge.full_state_dict(b)
    return {"a": la, "b": lb, "same_state": all(torch.equal(sa[k], sb[k]) for k in sa),
            "in_memory": in_memory, "read_back": read_back, "states": sum(1 for _, s in saved.values() if s),
            "nvme": zerobridge.stats(b)["tier_bytes"]["nvme"]}


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "spec_args"), [
    ("optimizer nvme, stage 2", (2, "nvme", "none", None)),
    ("both nvme, stage 3, bf16", (3, "nvme", "nvme", BF16)),
])
def test_checkpoint_access_round_trips_through_the_swap_files(pair: Cluster, nvme: Path, name: str,
                                                              spec_args: tuple[Any, ...]) -> None:
    n, optimizer, parameters, precision = spec_args
    base = stage(n, precision=precision) if precision else stage(n)
    spec = with_offload(base, nvme, optimizer=optimizer, parameters=parameters, sub_group_size=64)
    results: Any = pair.run(f"{HERE}:access_round_trip", spec=spec)
    for r in results:
        assert r["states"] > 0 and r["read_back"]
        assert r["in_memory"] == 0, "written state went to the file, not into optimizer.state"
        assert r["nvme"] > 0
        assert r["a"] == r["b"], "the restored engine continues exactly where the first one was"
        assert r["same_state"]
