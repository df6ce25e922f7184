"""Meta-device models: prepare materializes them with the values of an eager build.

Unit tests replay in this process; distributed ones build on meta on every
rank of a gloo group (world 1, 2, 4; one group per size for the module) and
compare the full state bitwise with the same model built eagerly in one
process from the same seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.runtime.deferred_init import Replay, is_meta_model, plan_ops
from zerobridge.spec import OffloadSpec, PrecisionSpec, ShardingSpec, StrategySpec, TransformerWrap
from zerobridge.testing.deferred import eager_state, meta_state

pytestmark = pytest.mark.usefixtures("solo_group")

META = "zerobridge.testing.deferred:meta_state"
NATIVE = "zerobridge.testing.parity:run_native"


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), f"{name}: max diff {(got[name].float() - value.float()).abs().max()}"


# ---------------------------------------------------------------------- unit: the replay


def test_replay_reproduces_eager_values_and_generator() -> None:
    torch.manual_seed(5)
    eager = eager_state("mixed", seed=5)
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    from zerobridge.testing.deferred import MixedNet

    with torch.device("meta"):
        model = MixedNet()
    replay = Replay(model)
    replay.record()
    assert torch.equal(torch.get_rng_state(), after_eager)
    values = dict(replay.materialize(replay.first))
    got = {replay.names[k]: v for k, v in values.items()}
    assert_same({k: got[k] for k in eager if k in got}, {k: eager[k] for k in got})
    assert torch.equal(torch.get_rng_state(), after_eager), "materialize leaves the generator where record did"
    # Out of order and one module at a time gives the same values.
    head = dict(replay.materialize(replay.params_of(model.head)))
    assert torch.equal(head[id(model.head.bias)], eager["head.bias"])


def test_construction_order_is_post_order_with_hf_scopes() -> None:
    from zerobridge.testing.deferred import BUILDERS

    with torch.device("meta"):
        llama = BUILDERS["llama"]()
    labels = [op.label for op in plan_ops(llama)]
    # Each layer's Linear resets run before LlamaModel's _init_weights pass; the head
    # is built (reset) after it and initialized by the outer model last.
    assert labels.index("model.embed_tokens.reset_parameters()") < labels.index(
        "LlamaModel._init_weights(model.embed_tokens)")
    assert labels.index("LlamaModel._init_weights(model)") < labels.index("lm_head.reset_parameters()")
    assert labels[-2:] == ["LlamaForCausalLM._init_weights(lm_head)", "LlamaForCausalLM._init_weights(root)"]


@pytest.mark.parametrize("name", ["llama", "mixed", "parity"])
def test_one_process_meta_equals_eager(name: str) -> None:
    assert_same(meta_state(model=name, stage=3)["state"], eager_state(name))


def test_gpt2_conv1d_draws_in_its_constructor() -> None:
    """GPT-2's Conv1D draws its weight in ``__init__`` (no reset method): a meta build
    cannot replay that, so its values differ from eager; they are still those of
    ``_init_weights`` (normal, std = initializer_range) at every stage (below)."""
    got = meta_state(model="gpt2", stage=0)["state"]
    eager = eager_state("gpt2")
    assert not torch.equal(got["transformer.h.0.attn.c_attn.weight"], eager["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(got["transformer.ln_f.weight"], eager["transformer.ln_f.weight"])
    assert abs(got["transformer.h.0.mlp.c_fc.weight"].std().item() - 0.02) < 2e-3


def test_uncovered_parameter_names_it_and_init_fn() -> None:
    with pytest.raises(ConfigError) as info:
        meta_state(model="bare", stage=3)
    assert "scaled.gain" in str(info.value) and "init_fn" in str(info.value)
    assert_same(meta_state(model="bare", stage=3, init_fn="scale_init")["state"], eager_state("bare"))


def test_init_fn_that_raises_is_named() -> None:
    import zerobridge

    def broken(module: nn.Module) -> None:
        raise RuntimeError("boom")

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"init_fn\(Linear\).*boom"):
        zerobridge.prepare(model, stage=3, init_fn=broken)


def test_partly_meta_model_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        model.append(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="partly on the meta device.*1.weight"):
        is_meta_model(model)


def test_init_fn_without_meta_model_is_refused() -> None:
    import zerobridge

    with pytest.raises(ConfigError, match="not on the meta device"):
        zerobridge.prepare(nn.Linear(2, 2), stage=3, init_fn=lambda m: None)


# ---------------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(1, 2, 4) as made:
        yield made


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["parity", "mixed"])
def test_meta_equals_eager_at_every_stage(clusters: dict[int, Cluster], name: str, stage: int, world: int) -> None:
    want = eager_state(name)
    results: list[Any] = clusters[world].run(META, model=name, stage=stage)
    for result in results:
        assert_same(result["state"], want)
    assert all(torch.equal(r["rng"], results[0]["rng"]) for r in results)


LAYOUTS = {
    "hybrid zero3 2x2": StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2), wrapping=TransformerWrap()),
    "hybrid zero2 2x2": StrategySpec(sharding=ShardingSpec.for_stage(2, shard_group=2)),
    "hpZ zero3 groups of 2": StrategySpec(sharding=ShardingSpec.for_stage(3, backward_gather_group=2)),
    "zero3 bf16, fp32 shard as master": StrategySpec(
        sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap(),
        precision=PrecisionSpec(param_dtype="bf16", compute_copy="gathered")),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_equals_eager_hybrid_and_hpz(clusters: dict[int, Cluster], layout: str) -> None:
    for result in clusters[4].run(META, model="parity", spec=LAYOUTS[layout]):
        assert_same(result["state"], eager_state("parity"))


def _offloaded(root: Path, optimizer: str, parameters: str, precision: dict[str, str] | None = None) -> StrategySpec:
    tiers: dict[str, Any] = {"optimizer": {"device": optimizer}, "parameters": {"device": parameters}}
    for tier in tiers.values():
        if tier["device"] == "nvme":
            tier["nvme_path"] = str(root)
    fields: dict[str, Any] = {"offload": OffloadSpec.model_validate(tiers)}
    if precision:
        fields["precision"] = precision
    return StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap(), **fields)


@pytest.mark.distributed
@pytest.mark.parametrize(("optimizer", "parameters", "precision"), [
    ("cpu", "cpu", None), ("nvme", "none", None), ("nvme", "nvme", None),
    ("nvme", "nvme", {"param_dtype": "bf16", "master_dtype": "fp32"})])
def test_meta_materializes_into_offload_tiers(clusters: dict[int, Cluster], tmp_path: Path, optimizer: str,
                                              parameters: str, precision: dict[str, str] | None) -> None:
    spec = _offloaded(tmp_path, optimizer, parameters, precision)
    want = eager_state("parity")
    for result in clusters[2].run(META, model="parity", spec=spec):
        assert_same(result["state"], want)  # with bf16 compute too: the full state is the fp32 master


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_meta_equals_eager(clusters: dict[int, Cluster], world: int) -> None:
    want = eager_state("llama")
    for stage in (0, 3):
        for result in clusters[world].run(META, model="llama", stage=stage):
            assert_same(result["state"], want)


@pytest.mark.distributed
def test_hf_gpt2_same_values_at_every_stage_and_world(clusters: dict[int, Cluster]) -> None:
    first = clusters[1].run(META, model="gpt2", stage=0)[0]["state"]
    for world, stage in ((2, 3), (4, 1), (4, 3)):
        for result in clusters[world].run(META, model="gpt2", stage=stage):
            assert_same(result["state"], first)


@pytest.mark.distributed
def test_ranks_seeded_differently_take_rank0_values(clusters: dict[int, Cluster]) -> None:
    results: list[Any] = clusters[2].run(META, model="mixed", stage=3, rank_seed=True)
    for result in results:
        assert_same(result["state"], eager_state("mixed", seed=0))
    torch.manual_seed(1)  # rank 1 gets its own generator back, untouched by the replay
    assert torch.equal(results[1]["rng"], torch.get_rng_state())


@pytest.mark.distributed
def test_uncovered_parameter_fails_on_every_rank(clusters: dict[int, Cluster]) -> None:
    with pytest.raises(RankError) as info:
        clusters[2].run(META, model="bare", stage=3)
    assert set(info.value.tracebacks) == {0, 1}
    assert all("scaled.gain" in text for text in info.value.tracebacks.values())


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_meta_built_model_trains_like_eager(clusters: dict[int, Cluster], stage: int) -> None:
    from zerobridge.testing.parity import run_reference

    ref = run_reference()
    for result in clusters[2].run(NATIVE, stage=stage, meta=True):
        assert result.losses == pytest.approx(ref.losses, rel=1e-5)  # type: ignore[attr-defined]


@pytest.mark.distributed
def test_prepare_never_holds_the_whole_model(clusters: dict[int, Cluster]) -> None:
    """Peak resident memory during prepare at stage 3, world 4: the meta path holds a
    quarter of the model plus one layer; the eager path (measured alike) the whole."""
    results: list[Any] = clusters[4].run("zerobridge.testing.deferred:prepare_peak", layers=24, width=1024)
    full = 24 * 1024 * 1024 * 4
    for result in results:
        assert result["eager"] >= 0.9 * full, result
        assert result["meta"] <= 0.5 * full, result
