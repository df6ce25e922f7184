"""Save once, resume anywhere: a checkpoint saved at (world 2, stage 3) resumes at
other stages, world sizes and a hybrid layout, and FSDP2 reads and writes the
same checkpoints; every resumed run's losses must equal the uninterrupted
single-process run's within 1e-5 relative.

The worker functions below run on the ranks of a ``Cluster`` (spawned
processes import this module by name: pytest puts ``tests/`` on ``sys.path``
and spawn hands it to the children).
"""

from __future__ import annotations

import importlib.util
import random
import shutil
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.spec import PrecisionSpec, ShardingSpec, StrategySpec
from zerobridge.testing.parity import ParityNet, batch, make_optimizer, run_reference
from zerobridge.testing.resume import GLOBAL_BATCH, clip_native, native, train_steps

pytestmark = pytest.mark.distributed

ME = "test_checkpoint_reshard"
STEPS, SAVED_AT, RTOL = 10, 5, 1e-5
HYBRID = StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2))


# ---------------------------------------------------------------------------- workers (run on every rank)

def _draws() -> list[float]:
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def train_and_save(path: str, stage: int | None = None, spec: StrategySpec | None = None) -> dict[str, Any]:
    """Train ``SAVED_AT`` steps, save, then record what each RNG draws next."""
    import zerobridge

    model, optimizer = native(0, stage, spec)
    losses = train_steps(model, optimizer, range(SAVED_AT), clip_native)
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    zerobridge.save_checkpoint(path, model, optimizer, metadata={"step": SAVED_AT, "note": "unit"})
    return {"losses": losses, "draws": _draws(), "full": zerobridge.full_state_dict(model)}


def resume(path: str, stage: int | None = None, spec: StrategySpec | None = None, start: int = SAVED_AT,
           out: str | None = None) -> dict[str, Any]:
    """A fresh model (another seed) and optimizer (other hyperparameters), loaded, trained
    from ``start`` to ``STEPS`` (to ``STEPS - 2`` and saved at ``out`` when given)."""
    import zerobridge

    model, optimizer = native(7, stage, spec)
    for group in optimizer.param_groups:  # the checkpoint must put the saved values back
        group["lr"], group["weight_decay"] = 1.0, 0.5
    metadata = zerobridge.load_checkpoint(path, model, optimizer)
    draws = _draws()
    losses = train_steps(model, optimizer, range(start, STEPS if out is None else STEPS - 2), clip_native)
    if out is not None:
        zerobridge.save_checkpoint(out, model, optimizer, metadata={"step": STEPS - 2})
    groups = [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return {"metadata": metadata, "draws": draws, "losses": losses, "groups": groups,
            "tiers": zerobridge.stats(model)["tier_bytes"]}


def _fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = ParityNet(seed)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, make_optimizer(list(model.named_parameters()), "adamw")


def _fsdp2_clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def fsdp2_resume(path: str) -> list[float]:
    """The standard FSDP2 resume code, on a zerobridge checkpoint. ``allow_partial_load``:
    ``get_optimizer_state_dict`` creates state for every trainable parameter, and one
    that never had a gradient (``ParityNet.unused``) has none in any checkpoint."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model, optimizer = _fsdp2(7)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
         planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return train_steps(model, optimizer, range(SAVED_AT, STEPS), _fsdp2_clip)


def fsdp2_train_and_save(path: str) -> list[float]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model, optimizer = _fsdp2(0)
    losses = train_steps(model, optimizer, range(SAVED_AT), _fsdp2_clip)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses


def save_full_weights(path: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    import zerobridge

    model, optimizer = native(0, 3, None)
    train_steps(model, optimizer, range(2), clip_native)
    zerobridge.save_full(path, model, dtype=dtype)
    full: dict[str, torch.Tensor] = zerobridge.full_state_dict(model)
    return full


def load_corrupted(path: str) -> None:
    model, optimizer = native(7, 2, None)
    import zerobridge

    zerobridge.load_checkpoint(path, model, optimizer)


def single_process_state(steps: int) -> Any:
    """``run_reference``'s first ``steps`` steps in one process, as a ``PortableState``
    (what a reader of another format, e.g. DeepSpeed's, hands to ``write_portable``)."""
    from zerobridge.checkpoint.portable import PortableState

    model = ParityNet(0)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    for step in range(steps):
        model(*batch(step, 0, GLOBAL_BATCH)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return PortableState(model=model.state_dict(),
                         optimizer={names[id(p)]: dict(s) for p, s in optimizer.state.items()},
                         param_groups=groups, metadata={"step": steps, "note": "unit"})


# ---------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(1, 2, 4) as made:
        yield made


@cache
def reference() -> list[float]:
    return run_reference(steps=STEPS).losses


@pytest.fixture(scope="module")
def saved(clusters: dict[int, Cluster], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    path = tmp_path_factory.mktemp("resume") / "ckpt"
    results = clusters[2].run(f"{ME}:train_and_save", path=str(path), stage=3)
    return path, results


def assert_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"loss {step}: {a} vs uninterrupted {b}"


def test_saving_run_matches_the_reference(saved: tuple[Path, list[Any]]) -> None:
    path, results = saved
    assert_losses(results[0]["losses"], reference()[:SAVED_AT])
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "zerobridge.json"]


@pytest.mark.parametrize(("world", "stage", "spec"), [
    (1, 0, None), (4, 1, None), (2, 2, None), (4, None, HYBRID),
], ids=["world1-stage0", "world4-stage1", "world2-stage2", "world4-hybrid2x2"])
def test_resume_anywhere_continues_the_uninterrupted_run(clusters: dict[int, Cluster], saved: tuple[Path, list[Any]],
                                                         world: int, stage: int | None,
                                                         spec: StrategySpec | None) -> None:
    path, before = saved
    results: list[Any] = clusters[world].run(f"{ME}:resume", path=str(path), stage=stage, spec=spec)
    assert_losses(results[0]["losses"], reference()[SAVED_AT:])
    for rank, result in enumerate(results):
        assert result["metadata"] == {"step": SAVED_AT, "note": "unit"}
        assert result["groups"] == [{"lr": 3e-2, "weight_decay": 0.1}, {"lr": 3e-2, "weight_decay": 0.0}]
        # rank r continues saved rank r mod 2's random streams
        assert result["draws"] == before[rank % 2]["draws"], f"rank {rank}"
    assert before[0]["draws"] != before[1]["draws"]


def test_fsdp2_job_resumes_from_our_checkpoint(clusters: dict[int, Cluster], saved: tuple[Path, list[Any]]) -> None:
    path, _ = saved
    results: list[Any] = clusters[2].run(f"{ME}:fsdp2_resume", path=str(path))
    assert_losses(results[0], reference()[SAVED_AT:])


@pytest.fixture(scope="module")
def fsdp2_saved(clusters: dict[int, Cluster], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    losses: list[Any] = clusters[2].run(f"{ME}:fsdp2_train_and_save", path=str(path))
    assert_losses(losses[0], reference()[:SAVED_AT])
    assert not (path / "zerobridge.json").exists()
    return path


def test_keys_and_values_are_fsdp2s(saved: tuple[Path, list[Any]], fsdp2_saved: Path) -> None:
    """At the same step, our checkpoint and FSDP2's hold the same model and optim keys,
    shapes, dtypes, param groups and (within float noise) values."""
    from zerobridge.checkpoint.portable import read_portable
    from zerobridge.checkpoint.reader import open_checkpoint

    with pytest.warns(UserWarning, match="has no zerobridge.json"):
        theirs = open_checkpoint(fsdp2_saved)
    ours = open_checkpoint(saved[0])
    keys = {k for k in theirs if k.startswith(("model.", "optim."))}
    assert {k for k in ours if k.startswith(("model.", "optim."))} == keys
    for key in keys:
        a, b = ours.tensor(key), theirs.tensor(key)
        assert (a is None) == (b is None), key
        if a is not None and b is not None:
            assert (a.size, a.properties.dtype) == (b.size, b.properties.dtype), key
    assert {k: ours.paths[k] for k in keys} == {k: theirs.paths[k] for k in keys}  # DCP's nested paths too
    with pytest.warns(UserWarning, match="has no zerobridge.json"):
        fsdp2 = read_portable(fsdp2_saved)
    mine = read_portable(saved[0])
    assert mine.param_groups == fsdp2.param_groups
    for name, value in fsdp2.model.items():
        assert (mine.model[name] - value).abs().max().item() < 1e-5, name
    for fqn, entries in fsdp2.optimizer.items():
        for key, value in entries.items():
            assert (mine.optimizer[fqn][key] - value).abs().max().item() < 1e-5, f"{fqn}.{key}"


def test_we_resume_from_an_fsdp2_checkpoint(clusters: dict[int, Cluster], fsdp2_saved: Path) -> None:
    path = fsdp2_saved
    results: list[Any] = clusters[4].run(f"{ME}:resume", path=str(path), stage=3)
    assert_losses(results[0]["losses"], reference()[SAVED_AT:])
    assert results[0]["metadata"] == {}


def test_every_rank_refuses_a_corrupted_checkpoint(clusters: dict[int, Cluster], saved: tuple[Path, list[Any]],
                                                   tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved[0], path)
    data = path / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(RankError) as info:
        clusters[2].run(f"{ME}:load_corrupted", path=str(path))
    assert sorted(info.value.tracebacks) == [0, 1]  # both ranks raise; none hangs
    for text in info.value.tracebacks.values():
        assert "CheckpointError" in text and "__1_0.distcp" in text and "altered or corrupted" in text


def test_a_portable_checkpoint_resumes_sharded(clusters: dict[int, Cluster], tmp_path: Path) -> None:
    from zerobridge.checkpoint.portable import write_portable

    path = write_portable(tmp_path / "portable", single_process_state(SAVED_AT))
    results: list[Any] = clusters[2].run(f"{ME}:resume", path=str(path), stage=3)
    assert_losses(results[0]["losses"], reference()[SAVED_AT:])
    assert results[0]["metadata"] == {"step": SAVED_AT, "note": "unit"}


@pytest.mark.parametrize(("change", "expected"), [
    ("shape", "has shape (3, 3); the model's parameter has (29, 13)"),
    ("missing", "missing 1: layers.0.up.weight"),
    ("groups", "holds 1 optimizer param group(s); this optimizer has 2"),
], ids=["shape", "missing", "groups"])
def test_a_checkpoint_of_another_model_is_refused(clusters: dict[int, Cluster], tmp_path: Path, change: str,
                                                  expected: str) -> None:
    from zerobridge.checkpoint.portable import write_portable

    state = single_process_state(1)
    if change == "shape":
        state.model["layers.0.up.weight"] = torch.zeros(3, 3)
    elif change == "missing":
        del state.model["layers.0.up.weight"]
    else:
        state.param_groups = state.param_groups[:1]
    path = write_portable(tmp_path / change, state)
    with pytest.raises(RankError) as info:
        clusters[1].run(f"{ME}:resume", path=str(path), stage=0)
    assert "CheckpointError" in str(info.value) and expected in str(info.value) and "fix:" in str(info.value)


def test_consolidate_equals_full_state_dict(saved: tuple[Path, list[Any]], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from zerobridge.checkpoint.full import consolidate

    path, results = saved
    consolidate(path, tmp_path / "model.safetensors")
    back = load_file(tmp_path / "model.safetensors")
    full = results[0]["full"]
    assert set(back) == set(full)
    for name, value in full.items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_save_full_reads_back_with_safetensors(clusters: dict[int, Cluster], tmp_path: Path,
                                               dtype: torch.dtype | None) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    full: Any = clusters[2].run(f"{ME}:save_full_weights", path=str(path), dtype=dtype)[0]
    back = load_file(path)
    assert set(back) == set(full) and "head.weight" in back and "embed.weight" in back  # tied: under each name
    for name, value in full.items():
        assert torch.equal(back[name], value if dtype is None else value.to(dtype)), name
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}  # what transformers' from_pretrained checks


def test_mixed_precision_saves_the_fp32_master(clusters: dict[int, Cluster], tmp_path: Path) -> None:
    from zerobridge.checkpoint.portable import read_portable

    precision = PrecisionSpec.model_validate({"param_dtype": "bf16", "master_dtype": "fp32"})
    spec = StrategySpec(sharding=ShardingSpec.for_stage(2), precision=precision)
    results: list[Any] = clusters[2].run(f"{ME}:train_and_save", path=str(tmp_path / "bf16"), spec=spec)
    back = read_portable(tmp_path / "bf16")
    for name, value in results[0]["full"].items():
        assert back.model[name].dtype == torch.float32 and torch.equal(back.model[name], value), name
    assert {t.dtype for entries in back.optimizer.values() for t in entries.values()} == {torch.float32}


def test_a_hybrid_save_writes_every_element_once(clusters: dict[int, Cluster], tmp_path: Path) -> None:
    """World 4, shard groups of 2: only the first replica writes, and DCP's checks
    (no overlap, full coverage) pass; every value reads back exactly."""
    from zerobridge.checkpoint.portable import read_portable

    results: list[Any] = clusters[4].run(f"{ME}:train_and_save", path=str(tmp_path / "hybrid"), spec=HYBRID)
    assert_losses(results[0]["losses"], reference()[:SAVED_AT])
    assert sorted(p.name for p in (tmp_path / "hybrid").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    back = read_portable(tmp_path / "hybrid")
    for name, value in results[0]["full"].items():
        assert torch.equal(back.model[name], value), name


OFFLOAD = importlib.util.find_spec("zerobridge.engine.tiers") is not None


def nvme(spec: StrategySpec, root: Path) -> StrategySpec:
    from zerobridge.spec import OffloadSpec

    tiers = {name: {"device": "nvme", "nvme_path": str(root)} for name in ("optimizer", "parameters")}
    return spec.model_copy(update={"offload": OffloadSpec.model_validate(tiers)})


@pytest.mark.skipif(not OFFLOAD, reason="this engine has no offload tiers")
def test_state_in_nvme_files_saves_and_loads(clusters: dict[int, Cluster], saved: tuple[Path, list[Any]],
                                            tmp_path: Path) -> None:
    """Load into an engine whose master values and optimizer state live in swap files,
    save from it, and resume that save without offload: every run goes through the
    access functions, never the files directly."""
    from zerobridge.spec.presets import spec_for_stage

    (tmp_path / "swap").mkdir()
    spec = nvme(spec_for_stage(3, ParityNet()), tmp_path / "swap")
    path = tmp_path / "from-nvme"
    results: list[Any] = clusters[2].run(f"{ME}:resume", path=str(saved[0]), spec=spec, out=str(path))
    assert_losses(results[0]["losses"], reference()[SAVED_AT:STEPS - 2])
    assert results[0]["tiers"]["nvme"] > 0
    resumed: list[Any] = clusters[2].run(f"{ME}:resume", path=str(path), stage=1, start=STEPS - 2)
    assert_losses(resumed[0]["losses"], reference()[STEPS - 2:])
