"""Meta-device models on the backends: FSDP2's meta path and DeepSpeed.

Each case builds a model under ``torch.device("meta")`` on every rank of a
gloo group, prepares it on a backend and compares its full state bitwise
with the same model built eagerly in one process from the same seed (as
tests/test_deferred_init.py does for the native engine). One group per
world size serves the FSDP2 cases (1, 2, 4); one group of 2 with
DeepSpeed's environment serves the DeepSpeed cases, which are slow and few.

    .venv/bin/python -m pytest -q tests/test_deferred_backends.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import REPO

from zerobridge.backends.deepspeed.materialize import Partitioner
from zerobridge.harness.cluster import Cluster
from zerobridge.harness.cluster import clusters as cluster_set
from zerobridge.spec import OffloadSpec, PrecisionSpec, RootWrap, ShardingSpec, StrategySpec, TransformerWrap
from zerobridge.testing.deferred import eager_state

META = "zerobridge.testing.deferred:meta_state"
TRAIN = "zerobridge.testing.fsdp_run:train"
DS_ENV = {"DS_ACCELERATOR": "cpu",
          "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}

pytestmark = pytest.mark.distributed


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), f"{name}: max diff {(got[name].float() - value.float()).abs().max()}"


def stage3(wrap: Any = None, **fields: Any) -> StrategySpec:
    """ZeRO-3 with ``wrap`` (default: one unit per layer of a model that names its layers)."""
    return StrategySpec(sharding=ShardingSpec.for_stage(3), wrapping=wrap or TransformerWrap(), **fields)


# MixedNet names no layers and ties its head (a unit of its own would hold the root's weight): one unit.
SPECS = {"parity": stage3(), "llama": stage3(), "mixed": stage3(RootWrap())}


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with cluster_set(1, 2, 4) as made:
        yield made


# ---------------------------------------------------------------------- FSDP2


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["parity", "mixed", "llama"])
def test_fsdp_meta_equals_eager(clusters: dict[int, Cluster], name: str, world: int) -> None:
    want = eager_state(name)
    results: list[Any] = clusters[world].run(META, model=name, spec=SPECS[name], backend="fsdp")
    for result in results:
        assert_same(result["state"], want)
    assert all(torch.equal(r["rng"], results[0]["rng"]) for r in results)


@pytest.mark.parametrize(("label", "spec", "cast"), [
    ("bf16 compute, fp32 master", stage3(precision=PrecisionSpec(param_dtype="bf16")), None),
    ("bf16 master and buffers", stage3(precision=PrecisionSpec(param_dtype="bf16", master_dtype="bf16",
                                                               buffer_dtype="bf16")), torch.bfloat16),
    ("hybrid 2x2", StrategySpec(sharding=ShardingSpec.for_stage(3, shard_group=2), wrapping=TransformerWrap()),
     None),
    ("cpu offload", stage3(offload=OffloadSpec.model_validate({"optimizer": {"device": "cpu"},
                                                               "parameters": {"device": "cpu"}})), None),
])
def test_fsdp_meta_precision_hybrid_offload(clusters: dict[int, Cluster], label: str, spec: StrategySpec,
                                            cast: torch.dtype | None) -> None:
    """The masters FSDP2 shards are in the spec's master dtype (``cast_states`` on meta), buffers
    in its buffer dtype; values are the eager ones cast once."""
    want = eager_state("parity")
    if cast is not None:
        want = {k: v.to(cast) if v.is_floating_point() else v for k, v in want.items()}
    for result in clusters[4].run(META, model="parity", spec=spec, backend="fsdp"):
        assert_same(result["state"], want)


def test_fsdp_meta_built_model_trains_like_eager(clusters: dict[int, Cluster]) -> None:
    """Same losses, norms and final parameters, step for step, as the eagerly built FSDP2 run."""
    eager: list[Any] = clusters[2].run(TRAIN, backend="fsdp", stage=3, steps=4)
    meta: list[Any] = clusters[2].run(TRAIN, backend="fsdp", stage=3, steps=4, meta=True)
    for a, b in zip(eager, meta):
        assert a.losses == b.losses
        assert a.grad_norms == b.grad_norms
        assert_same(b.state, a.state)


# ---------------------------------------------------------------------- DeepSpeed


def ds_meta_state(*, model: str, stage: int, dtype: str = "fp32") -> dict[str, Any]:
    """On every rank: ``model`` built on meta from seed 0, prepared on DeepSpeed (with the optimizer
    DeepSpeed needs); its full state, and what this rank holds of each parameter (numel)."""
    import zerobridge
    from zerobridge.spec.presets import spec_for_stage
    from zerobridge.testing.deferred import BUILDERS

    torch.manual_seed(0)
    with torch.device("meta"):
        built = BUILDERS[model]()
    spec = spec_for_stage(stage, built)
    if dtype == "bf16":
        spec = spec.model_copy(update={"precision": PrecisionSpec(param_dtype="bf16")})
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-3)
    whole: list[int] = []  # at each conversion: elements of real, not yet partitioned parameters
    convert = Partitioner.__call__

    def counted(self: Partitioner, params: list[torch.nn.Parameter]) -> None:
        whole.append(sum(p.numel() for p in built.parameters() if not p.is_meta and not hasattr(p, "ds_id")))
        convert(self, params)

    with mock.patch.object(Partitioner, "__call__", counted):
        prepared, _ = zerobridge.prepare(built, optimizer, config=spec, backend="deepspeed")
    held = {name: int(getattr(p, "ds_tensor", p).numel()) for name, p in prepared.named_parameters()}
    state = {k: v.detach().cpu().clone() for k, v in zerobridge.full_state_dict(prepared).items()}
    return {"state": state, "held": held, "whole": whole}


@pytest.fixture(scope="module")
def ds_cluster() -> Iterator[Cluster]:
    pytest.importorskip("deepspeed")
    with Cluster(2, timeout_s=300, env=DS_ENV) as made:  # the first run may JIT-build DeepSpeed's shm op
        yield made


@pytest.mark.parametrize(("name", "stage", "dtype"), [("parity", 1, "fp32"), ("parity", 3, "fp32"),
                                                      ("mixed", 3, "bf16")])
def test_deepspeed_meta_equals_eager(ds_cluster: Cluster, name: str, stage: int, dtype: str) -> None:
    """Stages 0-2 materialize whole; stage 3 partitions parameter by parameter, each rank keeping
    about half of every large one. bf16: the fp32 masters are the eager values all the same."""
    want = eager_state(name)
    if dtype == "bf16":  # DeepSpeed keeps a frozen parameter in the compute dtype only (an eager build too)
        want.update({k: v.to(torch.bfloat16).float() for k, v in want.items() if k.startswith("frozen.")})
    for result in ds_cluster.run("test_deferred_backends:ds_meta_state", model=name, stage=stage, dtype=dtype):
        assert_same(result["state"], want)
        if stage == 3:
            full = {k: v.numel() for k, v in want.items()}
            assert result["held"]["embed.weight"] <= full["embed.weight"] // 2 + 1, result["held"]
            # Partitioned as it went: never more than one (the largest) parameter whole at a time.
            assert result["whole"] and max(result["whole"]) <= max(full.values()), result["whole"]
