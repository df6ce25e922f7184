"""``torch.compile`` with every engine, against a single-process eager reference.

Compiled runs train ``ParityNet`` exactly as tests/test_engine_parity.py does
and must match one eager process within 1e-5 (relative, loss and grad norm
per step). ``compile="spec"`` (``prepare(..., compile=True)``) runs with
``fullgraph=True``: a graph break inside a unit's forward raises there. The
graph count dynamo reports after each step must not grow after the second
step: a recompile fails the test. The unit tests at the bottom show both
checks failing on a unit that breaks its graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import zerobridge
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import Cluster
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.spec import (
    CheckpointSpec,
    CompileScope,
    CompileSpec,
    DynamicLossScale,
    PrecisionSpec,
    ShardingSpec,
    StrategySpec,
    TransformerWrap,
)
from zerobridge.testing.parity import RunResult, run_reference

pytestmark = pytest.mark.distributed

NATIVE = "zerobridge.testing.parity:run_native"
TRAIN = "zerobridge.testing.fsdp_run:train"
RTOL, ATOL = 1e-5, 5e-5
UNITS = CompileSpec(enabled=True, fullgraph=True)


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(2, 4) as made:
        yield made


@cache
def reference(optimizer: str = "adamw", accumulation: int = 1, steps: int = 10) -> RunResult:
    return run_reference(optimizer=optimizer, accumulation=accumulation, steps=steps)


def compiled(stage: int, **fields: Any) -> StrategySpec:
    """The stage's spec (as ``prepare(stage=N)`` builds it for ParityNet) with compilation on."""
    wrap: Any = TransformerWrap() if stage == 3 else None
    base = StrategySpec(sharding=ShardingSpec.for_stage(stage), **({"wrapping": wrap} if wrap else {}))
    return base.model_copy(update={"compile": UNITS, **fields})


def assert_matches(got: RunResult, ref: RunResult, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert len(got.losses) == len(ref.losses)
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= rtol * abs(b), f"loss at step {step}: {a} vs eager reference {b}"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        if not math.isfinite(b):  # an overflowed fp16 step: it must overflow here too
            assert not math.isfinite(a), f"grad norm at step {step}: {a} where the eager run overflowed"
            continue
        assert abs(a - b) <= rtol * abs(b), f"grad norm at step {step}: {a} vs eager reference {b}"
    for name, value in ref.state.items():
        err = (got.state[name].float() - value).abs().max().item()
        assert err <= atol, f"{name}: max abs error {err}"


def assert_no_recompile(result: RunResult) -> None:
    assert result.graphs and result.graphs[0] >= 1, "nothing was compiled"
    assert result.graphs[1:] == [result.graphs[1]] * (len(result.graphs) - 1), \
        f"graphs after each step {result.graphs}: recompiled after the second step"


# ---------------------------------------------------------------------------- native engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_stage_matches_eager_single_process(clusters: dict[int, Cluster], world: int, stage: int) -> None:
    results: Any = clusters[world].run(NATIVE, spec=compiled(stage), compile="spec")
    for result in results:
        assert result.losses == results[0].losses
        assert result.graph_breaks == 0
        assert_no_recompile(result)
    assert_matches(results[0], reference())


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("stage", [0, 3])
def test_torch_compile_before_or_after_prepare(clusters: dict[int, Cluster], stage: int, when: str) -> None:
    results: Any = clusters[2].run(NATIVE, stage=stage, compile=when)
    assert_no_recompile(results[0])
    assert_matches(results[0], reference())


FEATURES = {
    "hybrid zero3 2x2": (4, compiled(3, sharding=ShardingSpec.for_stage(3, shard_group=2)), {}),
    "hpZ zero3 groups of 2": (4, compiled(3, sharding=ShardingSpec.for_stage(3, backward_gather_group=2)), {}),
    "activation checkpointing": (2, compiled(3, checkpoint=CheckpointSpec(activation_checkpointing=True)), {}),
    "accumulation, no_sync": (2, compiled(2), {"accumulation": 2, "accumulation_mode": "no_sync"}),
    "accumulation, spec": (2, compiled(1), {"accumulation": 2}),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_compiled_features_match_eager_single_process(clusters: dict[int, Cluster], name: str) -> None:
    world, spec, options = FEATURES[name]
    results: Any = clusters[world].run(NATIVE, spec=spec, compile="spec", optimizer="sgd", **options)
    assert results[0].graph_breaks == 0
    assert_no_recompile(results[0])
    assert_matches(results[0], reference("sgd", accumulation=options.get("accumulation", 1)))


def test_compiled_bf16_matches_eager_bf16(clusters: dict[int, Cluster]) -> None:
    precision = PrecisionSpec(param_dtype="bf16", master_dtype="fp32", reduce_dtype="fp32")
    spec = compiled(3, precision=precision)
    eager: Any = clusters[2].run(NATIVE, spec=spec.model_copy(update={"compile": CompileSpec()}), optimizer="sgd")
    got: Any = clusters[2].run(NATIVE, spec=spec, compile="spec", optimizer="sgd")
    assert got[0].graph_breaks == 0
    assert_no_recompile(got[0])
    # Inductor fuses bf16 arithmetic differently from eager kernels: agreement at bf16's precision.
    assert_matches(got[0], eager[0], rtol=1e-2, atol=1e-2)
    assert_matches(got[0], reference("sgd"), rtol=2e-2, atol=2e-2)


def test_compiled_fp16_loss_scaling_skips_the_same_steps(clusters: dict[int, Cluster]) -> None:
    scaling = DynamicLossScale(initial_scale=2.0**20, hysteresis=1, growth_interval=1000)
    spec = compiled(2, precision=PrecisionSpec(param_dtype="fp16", master_dtype="fp32", reduce_dtype="fp32",
                                               loss_scaling=scaling))
    eager: Any = clusters[2].run(NATIVE, spec=spec.model_copy(update={"compile": CompileSpec()}), optimizer="sgd")
    got: Any = clusters[2].run(NATIVE, spec=spec, compile="spec", optimizer="sgd")
    assert [s["skipped_steps"] for s in got[0].stats] == [s["skipped_steps"] for s in eager[0].stats]
    assert got[0].stats[-1]["skipped_steps"] >= 1, "2^20 overflows fp16: some steps are skipped"
    assert_no_recompile(got[0])
    assert_matches(got[0], eager[0], rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- the other backends


@pytest.mark.parametrize(("backend", "stage"), [("fsdp", 3), ("fsdp", 2), ("deepspeed", 1), ("deepspeed", 3)])
def test_compiled_backends_match_their_eager_runs(clusters: dict[int, Cluster], backend: str, stage: int) -> None:
    """Compiled vs eager on the same backend (DeepSpeed decays a parameter no forward uses,
    eager or not), and losses vs one eager process."""
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    spec = compiled(stage)
    eager: Any = clusters[2].run(TRAIN, backend=backend, spec=spec.model_copy(update={"compile": CompileSpec()}),
                                 allow_approximate=True)
    got: Any = clusters[2].run(TRAIN, backend=backend, spec=spec, allow_approximate=True)
    assert_matches(got[0], eager[0])
    assert max(abs(a - b) / b for a, b in zip(got[0].losses, reference().losses)) <= RTOL


# ---------------------------------------------------------------------------- one process, no cluster


class Breaking(nn.Module):
    """A unit whose forward reads a value on the host: dynamo must break its graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum().item() > 1e9:  # data-dependent control flow: a graph break
            y = y * 2
        return y


class TwoBlocks(nn.Module):
    _no_split_modules = ["Breaking"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Breaking(), Breaking()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.fixture
def one_rank() -> Iterator[None]:
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _train(model: nn.Module, steps: int = 3) -> list[int]:
    from torch._dynamo.utils import counters

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs = []
    for step in range(steps):
        model(torch.full((2, 4), float(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def test_a_graph_break_inside_a_unit_is_caught(one_rank: None) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec = StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=TransformerWrap(),
                        compile=CompileSpec(enabled=True, backend="eager"))
    model = zerobridge.prepare(TwoBlocks(), config=spec)
    _train(model)
    assert sum(counters["graph_break"].values()) > 0, "the check the parity tests rely on sees breaks"
    torch.distributed.destroy_process_group()
    torch._dynamo.reset()
    strict = spec.model_copy(update={"compile": CompileSpec(enabled=True, backend="eager", fullgraph=True)})
    model = zerobridge.prepare(TwoBlocks(), config=strict)
    with pytest.raises(Exception, match="(?i)graph break|Unsupported|item"):
        _train(model)


def test_a_recompile_is_caught(one_rank: None) -> None:
    torch._dynamo.reset()
    spec = StrategySpec(compile=CompileSpec(enabled=True, backend="eager", dynamic=False))
    model = zerobridge.prepare(nn.Sequential(nn.Linear(4, 4)), config=spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from torch._dynamo.utils import counters

    counters.clear()
    graphs = []
    for rows in (2, 2, 3):  # a new input shape on the third step
        model(torch.ones(rows, 4)).sum().backward()
        optimizer.step()
        graphs.append(counters["stats"]["unique_graphs"])
    result = RunResult(graphs=graphs)
    with pytest.raises(AssertionError, match="recompiled"):
        assert_no_recompile(result)


def _llama(use_cache: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=64,
                                      use_cache=use_cache)
    return transformers.LlamaForCausalLM(config)


def _train_llama(compile: bool) -> tuple[list[float], list[int]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = zerobridge.prepare(_llama(use_cache=False), stage=3, compile=compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, graphs = [], []
    for step in range(3):
        ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0
    torch.distributed.destroy_process_group()
    return losses, graphs


def test_hugging_face_llama_compiles_one_graph_for_every_layer(one_rank: None) -> None:
    eager, _ = _train_llama(compile=False)
    losses, graphs = _train_llama(compile=True)
    assert graphs == [1, 1, 1], "three decoder layers share one graph; none recompiles"
    assert max(abs(a - b) / b for a, b in zip(losses, eager)) <= RTOL


def test_a_kv_cache_in_training_is_named(one_rank: None) -> None:
    with pytest.warns(UserWarning, match="use_cache = False"):
        zerobridge.prepare(_llama(use_cache=True), stage=3, compile=True)


def test_compile_targets_are_the_innermost_units() -> None:
    from zerobridge.runtime.compile import compile_targets
    from zerobridge.runtime.wrap_units import unit_modules

    model = TwoBlocks()
    units = unit_modules(model, TransformerWrap())
    assert compile_targets(units, CompileScope.UNITS) == list(model.blocks)
    assert compile_targets(units, CompileScope.MODEL) == [model]
    assert compile_targets([model], CompileScope.UNITS) == [model]


def test_compile_settings_that_cannot_work_are_refused(one_rank: None) -> None:
    with pytest.raises(ConfigError, match="compile.backend") as error:
        zerobridge.prepare(TwoBlocks(), config=StrategySpec(compile=CompileSpec(enabled=True, backend="inductr")))
    assert "inductor" in (error.value.fix or "")
    with pytest.raises(ConfigError, match="compile.fullgraph"):
        zerobridge.prepare(TwoBlocks(), config=StrategySpec(compile=CompileSpec(
            enabled=True, fullgraph=True, scope=CompileScope.MODEL)))
    with pytest.raises(ConfigError, match="compiled before prepare") as error:
        zerobridge.prepare(torch.compile(TwoBlocks()), stage=3, compile=True)
    assert "compile once" in (error.value.fix or "")
    with pytest.raises(ValueError, match="compile.backend is empty"):
        CompileSpec(backend=" ")


def test_prepare_keeps_the_compiled_wrapper_and_the_plain_names(one_rank: None) -> None:
    torch._dynamo.reset()
    wrapper = torch.compile(TwoBlocks(), backend="eager")
    prepared = zerobridge.prepare(wrapper, stage=3)
    assert prepared is wrapper
    _train(prepared, steps=2)
    assert sorted(zerobridge.full_state_dict(prepared)) == sorted(TwoBlocks().state_dict()), \
        "sharded state carries no _orig_mod. prefix"


def test_compile_flag_overrides_the_spec_and_the_environment(one_rank: None, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.setenv("ZEROBRIDGE_COMPILE", "1")
    model = zerobridge.prepare(TwoBlocks(), stage=3)
    assert model.zerobridge_engine.plan.spec.compile.enabled  # type: ignore[union-attr,operator]
    torch.distributed.destroy_process_group()
    model = zerobridge.prepare(TwoBlocks(), stage=3, compile=False)
    assert not model.zerobridge_engine.plan.spec.compile.enabled  # type: ignore[union-attr,operator]
    monkeypatch.setenv("ZEROBRIDGE_COMPILE", "maybe")
    torch.distributed.destroy_process_group()
    with pytest.raises(ConfigError, match="ZEROBRIDGE_COMPILE"):
        zerobridge.prepare(TwoBlocks(), stage=3)
