"""load_pretrained: weights from files and checkpoints into a prepared model, each
rank reading only its own runs.

Unit tests read files in this process; distributed ones prepare a meta-built
model on every rank of a gloo group and compare the full state with the model
that wrote the weights.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zerobridge
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.pretrained.files import open_weights
from zerobridge.pretrained.load import match_names
from zerobridge.spec import PrecisionSpec, ShardingSpec, StrategySpec, TransformerWrap
from zerobridge.testing.deferred import BUILDERS, eager_state

pytestmark = pytest.mark.usefixtures("solo_group")

LOAD = "zerobridge.testing.deferred:load_state"


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


# ---------------------------------------------------------------------- unit: files and names


def test_range_reads_touch_only_their_bytes(tmp_path: Path) -> None:
    values = {"a": torch.randn(7, 5), "b": torch.randn(4).to(torch.bfloat16), "c": torch.arange(3)}
    save_file(values, str(tmp_path / "w.safetensors"))
    weights = open_weights(tmp_path / "w.safetensors")
    assert weights.read("a", 6, 23).tolist() == values["a"].reshape(-1)[6:23].tolist()
    assert torch.equal(weights.read("b", 1, 4), values["b"][1:4])
    assert torch.equal(weights.read("c", 0, 3), values["c"])
    assert weights.read("a", 3, 3).numel() == 0


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ConfigError, match=r"model.safetensors.*truncated: tensor w ends at byte"):
        open_weights(tmp_path)
    path.write_bytes(data[:20])
    with pytest.raises(ConfigError, match="truncated: its header alone"):
        open_weights(path)


def test_missing_path_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_weights(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"holds none of model.safetensors.index.json"):
        open_weights(tmp_path)


def test_index_with_a_missing_shard(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="names shard model-00002-of-00002.safetensors"):
        open_weights(tmp_path)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("code ran",))


def test_pickle_files_load_only_tensors(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "ok.bin")
    assert open_weights(tmp_path / "ok.bin").read("w", 0, 3).tolist() == [1.0, 1.0, 1.0]
    with (tmp_path / "evil.bin").open("wb") as fh:
        pickle.dump({"w": _Evil()}, fh)
    with pytest.raises(ConfigError, match=r"evil.bin.*weights_only=True"):
        open_weights(tmp_path / "evil.bin")


def test_names_match_with_prefixes_and_ties() -> None:
    targets = [("model.embed.weight", "lm_head.weight"), ("model.norm.weight",), ("head.bias",)]
    chosen, unexpected = match_names(targets, ["embed.weight", "norm.weight", "extra"], ["model."])
    assert chosen == ["embed.weight", "norm.weight", None]
    assert unexpected == ["extra"]
    chosen, unexpected = match_names([("embed.weight",)], ["model.embed.weight", "lm_head.weight"], ["model."])
    assert chosen == ["model.embed.weight"] and unexpected == ["lm_head.weight"]


def test_mismatches_are_one_error_listing_all(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model = zerobridge.prepare(model, stage=3)
    save_file({"0.weight": torch.ones(2, 4), "0.bias": torch.ones(2), "9.weight": torch.ones(1)},
              str(tmp_path / "w.safetensors"))
    with pytest.raises(ConfigError) as info:
        zerobridge.load_pretrained(model, tmp_path / "w.safetensors")
    text = str(info.value)
    assert "0.weight: [2, 4] in the file, [2, 3] in the model" in text
    assert "missing from the file: 1.weight, 1.bias" in text and "not the model: 9.weight" in text
    assert "strict=False" not in text  # a shape mismatch is never allowed


def test_strict_false_loads_what_matches(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model = zerobridge.prepare(model, stage=3)
    save_file({"0.weight": torch.full((2, 3), 2.0), "0.bias": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    report = zerobridge.load_pretrained(model, tmp_path / "w.safetensors", strict=False)
    assert report.missing == ["1.weight", "1.bias"] and report.loaded == 2
    assert zerobridge.full_state_dict(model)["0.weight"].eq(2.0).all()


# ---------------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(1, 2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """save_pretrained of a tiny Llama from seed 1: one file, shards with an index, .bin."""
    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(1)
    model = BUILDERS["llama"]()
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    model.model.save_pretrained(root / "base")  # LlamaModel: names without "model."
    torch.save(model.state_dict(), root / "weights.bin")
    return {"one": root / "one", "sharded": root / "sharded", "base": root / "base", "bin": root / "weights.bin"}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kind", ["one", "sharded", "base", "bin"])
def test_save_pretrained_round_trip(clusters: dict[int, Cluster], llama_dirs: dict[str, Path], kind: str,
                                    stage: int, world: int) -> None:
    assert (llama_dirs["sharded"] / "model.safetensors.index.json").is_file()
    want = eager_state("llama", seed=1)
    for result in clusters[world].run(LOAD, model="llama", source=str(llama_dirs[kind]), stage=stage):
        assert_same(result["state"], want)
        assert result["missing"] == [] and result["unexpected"] == []


@pytest.mark.distributed
def test_each_rank_reads_its_share(clusters: dict[int, Cluster], llama_dirs: dict[str, Path]) -> None:
    total = sum(e.numel * e.dtype.itemsize for e in open_weights(llama_dirs["one"]).entries.values())
    full = clusters[4].run(LOAD, model="llama", source=str(llama_dirs["one"]), stage=0)
    sharded = clusters[4].run(LOAD, model="llama", source=str(llama_dirs["one"]), stage=3)
    assert all(r["bytes_read"] == total for r in full)  # stage 0 holds replicas
    for result in sharded:  # a quarter, plus persistent small parameters (norms) read whole
        assert result["bytes_read"] <= 0.3 * total, (result["bytes_read"], total)
    assert sum(r["bytes_read"] for r in sharded) <= 1.1 * total


@pytest.mark.distributed
def test_hybrid_and_fsdp_backend_load(clusters: dict[int, Cluster], llama_dirs: dict[str, Path]) -> None:
    want = eager_state("llama", seed=1)
    hybrid = StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2), wrapping=TransformerWrap())
    for result in clusters[4].run(LOAD, model="llama", source=str(llama_dirs["sharded"]), spec=hybrid):
        assert_same(result["state"], want)
    fsdp_layout = StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap(),
                               precision=PrecisionSpec(param_dtype="bf16", compute_copy="gathered"))
    for result in clusters[2].run(LOAD, model="llama", source=str(llama_dirs["sharded"]), spec=fsdp_layout):
        assert_same(result["state"], want)  # fp32 shards loaded exactly: no bf16 round trip
    for result in clusters[2].run(LOAD, model="parity", source=str(_parity_file(llama_dirs)), stage=3,
                                  backend="fsdp"):
        assert_same(result["state"], eager_state("parity", seed=1))


def _parity_file(llama_dirs: dict[str, Path]) -> Path:
    path = llama_dirs["one"].parent / "parity.safetensors"
    if not path.exists():
        state = eager_state("parity", seed=1)
        state.pop("head.weight")  # tied to embed.weight: saved once, as save_pretrained does
        save_file(state, str(path))
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("saved_stage", [1, 3])
def test_own_and_dcp_checkpoints_load(clusters: dict[int, Cluster], tmp_path: Path, saved_stage: int) -> None:
    path = tmp_path / "ckpt"
    clusters[2].run("zerobridge.testing.deferred:save_checkpoint_of", model="parity", path=str(path),
                    stage=saved_stage)
    want = eager_state("parity", seed=1)
    for result in clusters[4].run(LOAD, model="parity", source=str(path), stage=3):
        assert_same(result["state"], want)


@pytest.mark.distributed
def test_shape_mismatch_fails_on_every_rank(clusters: dict[int, Cluster], tmp_path: Path) -> None:
    state = eager_state("parity", seed=1)
    state["layers.0.up.weight"] = torch.zeros(3, 3)
    save_file({k: v for k, v in state.items() if k != "head.weight"}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(RankError) as info:
        clusters[2].run(LOAD, model="parity", source=str(tmp_path / "bad.safetensors"), stage=3)
    assert set(info.value.tracebacks) == {0, 1}
    assert all("layers.0.up.weight: [3, 3] in the file" in t for t in info.value.tracebacks.values())


@pytest.mark.distributed
def test_load_never_holds_the_whole_model(clusters: dict[int, Cluster], tmp_path: Path) -> None:
    layers, width = 24, 1024
    torch.manual_seed(0)
    save_file({f"{i}.weight": torch.randn(width, width) for i in range(layers)}, str(tmp_path / "big.safetensors"))
    full = layers * width * width * 4
    for result in clusters[4].run("zerobridge.testing.deferred:load_peak", layers=layers, width=width,
                                  source=str(tmp_path / "big.safetensors")):
        assert result["bytes_read"] <= 0.26 * full
        assert result["rise"] <= 0.5 * full, result
