"""Running beyond this machine: older torch, prepared models that move, device binding.

Worker functions below run on the ranks of a ``Cluster`` (spawned once per
world size for the module); the other tests run in this process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerobridge.engine import collectives
from zerobridge.harness.cluster import Cluster
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.testing.parity import run_native, run_reference

ME = "tests.test_engine_infra"
NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(2) as made:
        yield made


# ---------------------------------------------------------------------- torch floor


def train_without_new_names(*, stage: int) -> dict[str, Any]:
    """Worker: train as a torch without the 2.13 names would, counting the older calls."""
    hidden = {name: getattr(dist, name) for name in NEW_NAMES}
    calls = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}
    older = {name: getattr(dist, name) for name in calls}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return older[name](*args, **kwargs)
        return call
    for name in NEW_NAMES:
        delattr(dist, name)
    for name in calls:
        setattr(dist, name, counted(name))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 2.13 deprecates the older names
            result = run_native(stage=stage, steps=3)
    finally:
        for name, fn in {**hidden, **older}.items():
            setattr(dist, name, fn)
    return {"losses": result.losses, "calls": calls}


def test_flat_collectives_fall_back_to_the_older_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert collectives.flat_collective("all_gather") is dist.all_gather_single
    for name in NEW_NAMES:
        monkeypatch.delattr(dist, name)
    assert collectives.flat_collective("all_gather") is dist.all_gather_into_tensor
    assert collectives.flat_collective("reduce_scatter") is dist.reduce_scatter_tensor


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_training_without_the_213_names_matches(clusters: dict[int, Cluster], stage: int) -> None:
    reference = run_reference(steps=3)
    for result in clusters[2].run(f"{ME}:train_without_new_names", stage=stage):
        assert result["calls"]["all_gather_into_tensor"] > 0 and result["calls"]["reduce_scatter_tensor"] > 0
        torch.testing.assert_close(result["losses"], reference.losses, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------- moving a prepared model


def _prepared(stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import zerobridge

    torch.manual_seed(0)
    model = zerobridge.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                                   torch.nn.Linear(4, 1)), stage=stage)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("convert", ["half", "double", "to_bf16", "to_meta"])
def test_a_cast_or_move_of_a_prepared_model_is_refused(solo_group: None, stage: int, convert: str) -> None:
    from zerobridge.errors import ConfigError

    model, _ = _prepared(stage)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    calls = {"half": lambda: model.half(), "double": lambda: model.double(),
             "to_bf16": lambda: model.to(torch.bfloat16), "to_meta": lambda: model.to("meta")}
    with pytest.raises(ConfigError, match="stale") as info:
        calls[convert]()
    assert "before zerobridge.prepare" in (info.value.fix or "")
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_conversion_that_changes_nothing_keeps_training_the_engine(solo_group: None, stage: int) -> None:
    import zerobridge

    model, opt = _prepared(stage)
    assert model.float() is model and model.to("cpu") is model and model.to(torch.float32) is model
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = zerobridge.full_state_dict(model)
    shown = dict(model.named_parameters())
    if stage == 0:  # one shard: the parameters are the whole tensors the engine steps
        for name, value in shown.items():
            torch.testing.assert_close(full[name], value.detach(), rtol=0, atol=0)
    with torch.no_grad():
        expected = torch.nn.functional.linear(torch.nn.functional.layer_norm(
            torch.nn.functional.linear(x, full["0.weight"], full["0.bias"]), (4,), full["1.weight"], full["1.bias"]),
            full["2.weight"], full["2.bias"])
        torch.testing.assert_close(model(x), expected)


# ---------------------------------------------------------------------- device binding


class _Recorder:
    """Stands in for ``init_process_group`` and ``set_device``: records the calls, then starts a
    one-rank gloo group so what follows has a group to look at."""

    def __init__(self) -> None:
        self.inits: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.devices: list[torch.device] = []
        self.real = dist.init_process_group

    def init(self, *args: Any, **kwargs: Any) -> None:
        self.inits.append((args, kwargs))
        self.real("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def set_device(self, device: torch.device) -> None:
        self.devices.append(device)


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch, solo_group: None) -> _Recorder:
    """Rank 3 of 4 under a launcher, second process of its node; calls recorded."""
    recorder = _Recorder()
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", recorder.init)
    monkeypatch.setattr(torch.cuda, "set_device", recorder.set_device)
    return recorder


def test_a_cuda_model_binds_local_ranks_gpu_before_the_group_starts(launcher: _Recorder) -> None:
    from zerobridge.distributed import init_distributed

    init_distributed(torch.nn.Linear(2, 2), torch.device("cuda"))  # where model.cuda() would put it
    assert launcher.devices == [torch.device("cuda", 1)]
    [(args, kwargs)] = launcher.inits
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 1)


def test_a_cpu_model_under_a_launcher_starts_gloo_unbound(launcher: _Recorder) -> None:
    from zerobridge.distributed import init_distributed

    init_distributed(torch.nn.Linear(2, 2))
    assert launcher.devices == []
    [(args, kwargs)] = launcher.inits
    assert args == ("gloo",) and kwargs["device_id"] is None


def test_a_model_on_another_ranks_gpu_is_refused(launcher: _Recorder) -> None:
    from zerobridge.distributed import init_distributed
    from zerobridge.errors import ConfigError

    with pytest.raises(ConfigError, match="LOCAL_RANK=1") as info:
        init_distributed(torch.nn.Linear(2, 2), torch.device("cuda", 0))
    assert "set_device" in (info.value.fix or "")
    assert launcher.inits == [] and launcher.devices == []


def _nccl_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default group reports NCCL alone (no CPU path), as on a GPU job."""
    real = dist.get_backend_config

    def config(group: Any = None) -> str:
        default = dist.distributed_c10d._get_default_group()
        return "cuda:nccl" if group is None or group is default else str(real(group))
    monkeypatch.setattr(dist, "get_backend_config", config)


def test_a_cpu_model_under_an_nccl_group_is_refused(monkeypatch: pytest.MonkeyPatch, solo_group: None) -> None:
    import zerobridge
    from zerobridge.errors import ConfigError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _nccl_only(monkeypatch)
    with pytest.raises(ConfigError, match="no CPU path") as info:
        zerobridge.prepare(torch.nn.Linear(2, 2), stage=3)
    assert "move the model to its GPU" in (info.value.fix or "") and "gloo" in (info.value.fix or "")


def test_a_host_tensor_never_reaches_an_nccl_group(monkeypatch: pytest.MonkeyPatch, solo_group: None) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _nccl_only(monkeypatch)
    monkeypatch.setattr(collectives, "group_size", lambda group: 2)  # a group of two ranks, as far as checks go
    default = dist.distributed_c10d._get_default_group()
    stats = collectives.CommStats()
    for issue in (lambda: collectives.all_reduce(torch.ones(2), default, stats),
                  lambda: collectives.all_gather(torch.ones(4), torch.ones(2), default, stats),
                  lambda: collectives.broadcast(torch.ones(2), 0, default, stats)):
        with pytest.raises(RuntimeError, match="no CPU path"):
            issue()
    assert not stats.calls


def save_and_load_under_nccl(*, path: str) -> dict[str, Any]:
    """Worker: the default group pretends to be NCCL alone; a save and a load must run
    every barrier and object collective on a gloo group."""
    import zerobridge
    from zerobridge.distributed import host_world
    from zerobridge.testing.parity import ParityNet, batch

    patch = pytest.MonkeyPatch()
    seen: list[Any] = []
    for name in ("barrier", "all_gather_object"):
        real = getattr(dist, name)

        def record(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            seen.append(kwargs.get("group"))
            return _real(*args, **kwargs)
        patch.setattr(dist, name, record)
    try:
        model = zerobridge.prepare(ParityNet(), stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(*batch(0, 0, 4)).backward()
        opt.step()
        _nccl_only(patch)  # after prepare: the engine's own tensors are on the CPU here
        zerobridge.save_checkpoint(path, model, opt)
        zerobridge.load_checkpoint(path, model, opt)
        twin = host_world()
        default = dist.distributed_c10d._get_default_group()
        return {"calls": len(seen), "on_default": sum(g is None or g is default for g in seen),
                "on_twin": sum(g is twin for g in seen), "twin_is_gloo": dist.get_backend(twin) == "gloo"}
    finally:
        patch.undo()


@pytest.mark.distributed
def test_checkpoint_barriers_run_on_a_gloo_group_under_nccl(clusters: dict[int, Cluster], tmp_path: Any) -> None:
    for result in clusters[2].run(f"{ME}:save_and_load_under_nccl", path=str(tmp_path / "ckpt")):
        assert result["calls"] > 0 and result["on_default"] == 0 and result["on_twin"] == result["calls"]
        assert result["twin_is_gloo"]


# ---------------------------------------------------------------------- checkpoints at scale


def full_state_to_rank0(*, spec: Any) -> dict[str, Any]:
    """Worker: the rank-0-only host gather against the every-rank one, with the largest
    full buffer any rank allocated on the way (a rank never holds the whole model)."""
    import zerobridge
    from zerobridge.engine import state as state_module
    from zerobridge.testing.parity import ParityNet, batch

    model = zerobridge.prepare(ParityNet(), config=spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(*batch(0, 0, 4)).backward()
    opt.step()
    everywhere = {k: v.clone() for k, v in zerobridge.full_state_dict(model).items()}
    largest: list[int] = []
    real = state_module.full_master

    def watched(group: Any, mesh: Any, stats: Any) -> torch.Tensor:
        full = real(group, mesh, stats)
        largest.append(full.numel())
        return full
    state_module.full_master = watched  # type: ignore[assignment]
    try:
        mine = zerobridge.full_state_dict(model, rank0_only=True, offload_to_cpu=True)
    finally:
        state_module.full_master = real  # type: ignore[assignment]
    total = sum(g.layout.numel for g in model.zerobridge_engine.groups)
    return {"everywhere": everywhere, "mine": mine, "largest": max(largest, default=0), "total": total}


@pytest.mark.distributed
def test_full_state_dict_gathers_group_by_group_to_rank0s_host(clusters: dict[int, Cluster]) -> None:
    from zerobridge.spec import ShardingSpec, StrategySpec, TransformerWrap

    spec = StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap())
    rank0, rank1 = clusters[2].run(f"{ME}:full_state_to_rank0", spec=spec)
    assert rank1["mine"] == {}
    assert set(rank0["mine"]) == set(rank0["everywhere"])
    for name, value in rank0["mine"].items():
        assert value.device.type == "cpu"
        torch.testing.assert_close(value, rank0["everywhere"][name], rtol=0, atol=0)
    assert 0 < rank0["largest"] < rank0["total"]  # one group at a time, never the whole model


def save_with_own_digests(*, path: str) -> dict[str, Any]:
    """Worker: a save in several files per rank; which files each rank hashed, how long it
    was ready to wait, and whether the checkpoint loads back verified."""
    import zerobridge
    from zerobridge.checkpoint import storage, writer
    from zerobridge.testing.parity import ParityNet, batch

    patch = pytest.MonkeyPatch()
    hashed: list[str] = []
    waits: list[float] = []
    real_digest, real_barrier = storage._digest, dist.monitored_barrier

    def digest(target: Any) -> tuple[int, str]:
        hashed.append(target.name)
        return real_digest(target)

    def barrier(*args: Any, **kwargs: Any) -> None:
        waits.append(kwargs["timeout"].total_seconds())
        real_barrier(*args, **kwargs)
    patch.setattr(storage, "_digest", digest)
    patch.setattr(dist, "monitored_barrier", barrier)
    patch.setattr(writer, "THREADED_BYTES", 0)  # every save is a large one
    try:
        model = zerobridge.prepare(ParityNet(), stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(*batch(0, 0, 4)).backward()
        opt.step()
        zerobridge.save_checkpoint(path, model, opt)
        saved = {k: v.clone() for k, v in zerobridge.full_state_dict(model).items()}
        hashed_on_save = sorted(hashed)
        fresh = zerobridge.prepare(ParityNet(seed=1), stage=3)
        zerobridge.load_checkpoint(path, fresh, strict=False)
        loaded = zerobridge.full_state_dict(fresh)
    finally:
        patch.undo()
    from zerobridge.distributed import group_timeout

    same = all(torch.equal(saved[k], loaded[k]) for k in saved)
    return {"hashed": hashed_on_save, "waits": waits, "same": same, "base": group_timeout().total_seconds()}


@pytest.mark.distributed
def test_each_rank_hashes_its_own_files_and_waits_by_bytes(clusters: dict[int, Cluster], tmp_path: Any) -> None:
    from pathlib import Path

    from zerobridge.checkpoint.writer import WRITER_THREADS

    path = tmp_path / "ckpt"
    results = clusters[2].run(f"{ME}:save_with_own_digests", path=str(path))
    files = sorted(p.name for p in Path(path).iterdir())
    for rank, result in enumerate(results):
        own = sorted(f for f in files if f.startswith(f"__{rank}_"))
        assert len(own) == WRITER_THREADS
        assert result["hashed"] == sorted(own + ([".metadata"] if rank == 0 else []))
        assert result["waits"] and result["waits"][0] > result["base"]  # plus this save's bytes
        assert result["same"]


def test_the_save_wait_scales_with_bytes() -> None:
    from zerobridge.checkpoint.writer import save_timeout

    per_rank_70b = 70e9 * 16 // 64  # fp32 master + AdamW moments + bf16 params, 64 ranks
    assert save_timeout(0) < save_timeout(1 << 30) < save_timeout(int(per_rank_70b))
    assert save_timeout(int(per_rank_70b)).total_seconds() > 600 + 1000
