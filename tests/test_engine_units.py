"""Engine pieces that need no process group: layout, units, plan, loss scale,
collective accounting; plus prepare's refusals, which happen before any group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zerobridge.engine.layout import plan_layout
from zerobridge.engine.mesh import layout_ranks
from zerobridge.engine.plan import plan_engine
from zerobridge.errors import ConfigError
from zerobridge.runtime.comm_stats import CommStats, bus_bytes
from zerobridge.runtime.loss_scale import LossScaler
from zerobridge.runtime.wrap_units import collect_params, owners, unit_modules
from zerobridge.spec import (
    BatchSpec,
    DynamicLossScale,
    EveryModuleWrap,
    OffloadSpec,
    PrecisionSpec,
    ShardingSpec,
    SizeWrap,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.testing.parity import ParityNet

# ----------------------------------------------------------------- layout


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 50), min_size=1, max_size=12), shards=st.integers(1, 5),
       cap=st.one_of(st.none(), st.integers(1, 80)))
def test_every_element_has_exactly_one_owner(numels: list[int], shards: int, cap: int | None) -> None:
    layouts = [plan_layout(numels, shards=shards, shard_rank=r, bucket_cap=cap) for r in range(shards)]
    first = layouts[0]
    assert first.numel % shards == 0 and first.numel - sum(numels) == first.padding
    for bucket in first.buckets:
        assert bucket.numel % shards == 0 and bucket.numel - bucket.data_numel < shards
        if cap is not None and len(bucket.params) > 1:
            assert bucket.data_numel <= cap
    for i, numel in enumerate(numels):
        covered: list[int] = []
        for layout in layouts:
            piece = layout.pieces[i]
            assert 0 <= piece.shard_start <= piece.shard_stop <= layout.shard_numel
            covered.extend(range(piece.param_start, piece.param_start + piece.numel))
            bucket = layout.bucket_of(i)
            own = bucket.offset + layout.shard_rank * bucket.piece
            if piece.numel:
                assert own <= piece.full_start and piece.full_start + piece.numel <= own + bucket.piece
                assert piece.shard_start - bucket.shard_offset == piece.full_start - own
        assert sorted(covered) == list(range(numel)), f"param {i} covered {covered}"


def test_a_parameter_larger_than_the_bucket_gets_its_own() -> None:
    layout = plan_layout([10, 100, 10], shards=2, shard_rank=0, bucket_cap=20)
    assert [list(b.params) for b in layout.buckets] == [[0], [1], [2]]


def test_rank_layout_is_shard_major() -> None:
    assert layout_ranks(world_size=8, shard_size=4) == ([[0, 1, 2, 3], [4, 5, 6, 7]],
                                                        [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert layout_ranks(world_size=4, shard_size=1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])


# ----------------------------------------------------------------- units


def test_tied_weight_belongs_to_the_common_unit() -> None:
    model = ParityNet()
    units = unit_modules(model, EveryModuleWrap())
    refs = collect_params(model)
    owner = dict(zip((r.names[0] for r in refs), owners(model, units, refs)))
    embed = next(r for r in refs if r.names[0] == "embed.weight")
    assert embed.names == ("embed.weight", "head.weight") and len(embed.slots) == 2
    assert owner["embed.weight"] == 0, "embedding and head are different units: the root owns the tied weight"
    assert units[owner["layers.0.up.weight"]] is model.layers[0].up
    assert len(refs) == len({id(r.param) for r in refs}) == sum(1 for _ in model.parameters())


def test_transformer_and_size_wrap() -> None:
    model = ParityNet()
    assert unit_modules(model, TransformerWrap()) == [model, *model.layers]
    small = unit_modules(model, SizeWrap(min_params=300))
    assert model.layers[0].up in small and model.frozen not in small
    with pytest.raises(ConfigError, match="choose among the model's classes"):
        unit_modules(model, TransformerWrap(layer_classes=("Block",)))
    with pytest.raises(ConfigError, match="_no_split_modules"):
        unit_modules(nn.Linear(2, 2), TransformerWrap())


def test_size_wrap_never_makes_a_container_a_unit() -> None:
    """A ModuleList is never called, so hooks on it would never gather it: its children are the units
    (torch's size-based policy skips containers the same way)."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 1))
    assert unit_modules(model, SizeWrap(min_params=30)) == [model]  # the list holds 60, each Linear 20
    assert unit_modules(model, SizeWrap(min_params=20)) == [model, *model[0]]


# ----------------------------------------------------------------- plan


def plan_for(spec: StrategySpec, world: int = 4, local: int = 2) -> object:
    return plan_engine(spec, ParityNet(), world_size=world, local_world_size=local)


def test_plan_resolves_groups_and_dtypes() -> None:
    plan = plan_for(StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group="node", backward_gather_group=1),
                                 precision=PrecisionSpec(param_dtype="bf16", master_dtype="fp32")))
    assert (plan.shard_size, plan.replicas, plan.secondary_size) == (2, 2, 1)  # type: ignore[attr-defined]
    assert plan.compute_dtype == torch.bfloat16 and plan.master_dtype == torch.float32  # type: ignore[attr-defined]
    assert plan.reduce_dtype == torch.bfloat16, "reduce dtype defaults to the compute dtype"  # type: ignore[attr-defined]
    stage0 = plan_for(StrategySpec())
    assert stage0.shard_size == 1 and stage0.replicas == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(("spec", "key", "fix"), [
    (StrategySpec(sharding=ShardingSpec.for_stage(2, shard_group=3)), "sharding.shard_group", "divisor of 4"),
    (StrategySpec(sharding=ShardingSpec.for_stage(2, world_size=8)), "sharding.world_size", "launch 8 ranks"),
    (StrategySpec(sharding=ShardingSpec.for_stage(3), offload=OffloadSpec.model_validate(
        {"optimizer": {"device": "cpu", "ratio": 0.5}})), "offload.optimizer.ratio", "ratio = 1.0"),
    (StrategySpec(sharding=ShardingSpec.for_stage(3), offload=OffloadSpec.model_validate(
        {"parameters": {"device": "nvme", "nvme_path": "/no/such/dir"}})), "offload.parameters.nvme_path", "mkdir"),
    (StrategySpec(sharding=ShardingSpec.for_stage(2), communication={"reduce_bucket": "auto"}),
     "communication.reduce_bucket", "number of elements"),
    (StrategySpec(batch=BatchSpec(micro_batch_size=2, accumulation_steps=None, global_batch_size=4)),
     "batch.global_batch_size", "global batch"),
])
def test_plan_refuses_what_it_cannot_run(spec: StrategySpec, key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as caught:
        plan_for(spec)
    assert caught.value.key == key and fix in str(caught.value)


def test_auto_sizes_come_from_the_hidden_size() -> None:
    model = ParityNet()
    model.config = type("Config", (), {"hidden_size": 10})()  # type: ignore[assignment]
    spec = StrategySpec(sharding=ShardingSpec.for_stage(3), communication={
        "reduce_bucket": "auto", "prefetch_bucket": "auto", "persistence_threshold": "auto"})
    plan = plan_engine(spec, model, world_size=2, local_world_size=2)
    assert (plan.reduce_bucket, plan.prefetch_bucket, plan.persistence_threshold) == (100, 90, 100)


def test_accumulation_derived_from_global_batch() -> None:
    spec = StrategySpec(batch=BatchSpec(micro_batch_size=2, accumulation_steps=None, global_batch_size=32))
    assert plan_for(spec).accumulation_steps == 4  # type: ignore[attr-defined]


# ----------------------------------------------------------------- loss scale, accounting


def test_dynamic_loss_scale_hysteresis_and_growth() -> None:
    scaler = LossScaler(DynamicLossScale(initial_scale=16.0, hysteresis=2, growth_interval=3, min_scale=4.0))
    seen = []
    for overflow in (True, True, True, True, False, False, False):
        scaler.update(found_inf=overflow)
        seen.append(scaler.scale)
    assert seen == [16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0]


def test_grad_norm_does_not_depend_on_how_gradients_are_sharded() -> None:
    """The native engine and the FSDP2 backend sum per-shard parts of the norm (``norm_part``):
    accumulated in float64, splitting a 12M-element gradient into shards of any size moves the
    global norm by float64 rounding only. In float32 the split alone moved it by ~1e-4."""
    from zerobridge.runtime.step_rules import apply_clip, norm_part

    torch.manual_seed(0)
    grad = torch.randn(12_000_000) * 1e-3
    exact = grad.double().pow(2).sum().sqrt().item()
    whole = norm_part([grad], 2.0, torch.device("cpu"))
    assert whole.dtype == torch.float64  # all-reduced in float64 too
    for shards in (2, 3, 8):
        parts = sum(norm_part([piece], 2.0, torch.device("cpu")) for piece in grad.tensor_split(shards))
        assert abs(parts.sqrt().item() - exact) / exact < 1e-12
    assert abs(whole.sqrt().item() - exact) / exact < 1e-12
    inf = norm_part(list(grad.tensor_split(3)), float("inf"), torch.device("cpu"))
    assert inf.item() == grad.abs().max().item()
    grads = [grad[:10].clone()]
    total = apply_clip(grads, norm_part(grads, 2.0, torch.device("cpu")), 1e-6, 2.0)
    assert total.dtype == torch.float32 and grads[0].dtype == torch.float32
    assert torch.linalg.vector_norm(grads[0].double()).item() == pytest.approx(1e-6, rel=1e-3)  # torch's +1e-6


def test_bus_volume_convention() -> None:
    stats = CommStats()
    stats.record("all_reduce", 1000, group_size=4)
    stats.record("reduce_scatter", 1000, group_size=4)
    stats.record("all_gather", 1000, group_size=4)
    assert dict(stats.bytes) == {"all_reduce": 1500, "reduce_scatter": 750, "all_gather": 750}
    assert bus_bytes("all_gather", torch.empty(10, dtype=torch.bfloat16), group_size=2) == 10


# ----------------------------------------------------------------- prepare's refusals (no group needed)


def test_prepare_refuses_bad_models_before_touching_the_group() -> None:
    import zerobridge

    with pytest.raises(ConfigError, match="no parameters"):
        zerobridge.prepare(nn.ReLU(), stage=1)
    partly_meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match="partly on the meta device"):
        zerobridge.prepare(partly_meta, stage=1)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="before the first optimizer.step"):
        zerobridge.prepare(model, optimizer, stage=1)
    with pytest.raises(ConfigError, match="name the strategy once"):
        zerobridge.prepare(model, stage=1, strategy="zero2")
    with pytest.raises(ConfigError, match="not a ZeRO stage"):
        zerobridge.prepare(model, stage=5)
    assert not torch.distributed.is_initialized()


