"""What only a GPU can show: CUDA side streams, pinned host reads, device binding, NCCL. ``make test-gpu``.

Every test here is marked ``gpu`` and skipped on a machine without CUDA, so
the CPU suite (``make test``) passes without one and ``make test-gpu``
(``pytest -m gpu``) reports them skipped, not missing. On a machine with
GPUs the process groups use NCCL (``ZEROBRIDGE_TEST_DEVICE=cuda``, which
``make test-gpu`` sets), one rank per GPU; the parity cases against the
single-process reference run where there are two GPUs or more. GPU kernels
sum in other orders than the CPU reference, so losses are held to 1e-4
(relative) here instead of the CPU suite's 1e-5.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerobridge.harness.cluster import Cluster
from zerobridge.spec import OffloadSpec, ShardingSpec, StrategySpec
from zerobridge.testing.parity import RunResult, run_reference

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA (make test-gpu on a GPU machine)")]

ME = "test_gpu"
NATIVE = "zerobridge.testing.parity:run_native"
LOSS_RTOL = 1e-4
NCCL = {"ZEROBRIDGE_TEST_DEVICE": "cuda"}


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[Cluster]:
    with Cluster(1, backend="nccl", env=NCCL) as cluster:
        yield cluster


def close_to(got: RunResult, ref: RunResult) -> None:
    assert len(got.losses) == len(ref.losses)
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"loss at step {step}: {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"grad norm at step {step}: {a} vs reference {b}"


# ----------------------------------------------------------------------------- one GPU, NCCL world 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_on_a_gpu_like_the_reference(one_gpu: Cluster, stage: int) -> None:
    (got,) = one_gpu.run(NATIVE, stage=stage, steps=6)
    close_to(got, run_reference(steps=6))


def streams_and_order(stage: int) -> dict[str, Any]:
    """Stage-``stage`` training on this rank's GPU with side streams, then again with streams turned
    off (every call on the current stream): the losses must be the same to the bit."""
    from zerobridge.engine import streams
    from zerobridge.testing.parity import run_native

    engine_streams: list[bool] = []
    real = streams.Streams.__init__

    def spy(self: Any, device: torch.device) -> None:
        real(self, device)
        engine_streams.append(self.overlaps)

    streams.Streams.__init__ = spy  # type: ignore[method-assign]
    try:
        with_streams = run_native(stage=stage, steps=4, collect_state=False)
    finally:
        streams.Streams.__init__ = real  # type: ignore[method-assign]
    saved = streams.stream_backend
    streams.stream_backend = lambda device: None  # type: ignore[assignment]
    try:
        without = run_native(stage=stage, steps=4, collect_state=False)
    finally:
        streams.stream_backend = saved  # type: ignore[assignment]
    return {"overlaps": engine_streams, "with": with_streams.losses, "without": without.losses}


@pytest.mark.parametrize("stage", [2, 3])
def test_side_streams_run_and_change_no_number(one_gpu: Cluster, stage: int) -> None:
    (got,) = one_gpu.run(f"{ME}:streams_and_order", stage=stage)
    assert got["overlaps"] == [True]  # gathers and reductions ran on side streams
    assert got["with"] == got["without"]


def pinned_host_reads() -> dict[str, Any]:
    """Stage 3 with the parameter tier on the host: the host shards are page-locked, so reading them
    into the device does not block the host; training still matches the reference."""
    import zerobridge
    from zerobridge.backends.base import backend_of
    from zerobridge.engine.swapfile import HostRegion
    from zerobridge.testing.parity import ParityNet, make_optimizer

    spec = StrategySpec(sharding=ShardingSpec.for_stage(3),
                        offload=OffloadSpec(parameters={"device": "cpu"}, optimizer={"device": "cpu"}))
    model = ParityNet(0).cuda()
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    model, optimizer = zerobridge.prepare(model, optimizer, config=spec)
    engine = backend_of(model).engine  # type: ignore[attr-defined]
    regions = [g.away for g in engine.groups if isinstance(g.away, HostRegion)]  # shards held on the host
    return {"regions": len(regions), "pinned": all(r.tensor.is_pinned() for r in regions),
            "device": str(next(model.parameters()).device)}


def test_host_shards_are_pinned(one_gpu: Cluster) -> None:
    (got,) = one_gpu.run(f"{ME}:pinned_host_reads")
    assert got["regions"] > 0 and got["pinned"], got
    assert got["device"].startswith("cuda")


# ----------------------------------------------------------------------------- every GPU, NCCL


def bound_devices() -> dict[str, Any]:
    """After ``prepare``: this rank's current device, the default group's backend, and whether a gloo
    twin carries host tensors for checkpoints."""
    import zerobridge
    from zerobridge.distributed import carries_host, host_world

    model = torch.nn.Linear(8, 8).cuda(int(os.environ["LOCAL_RANK"]))
    zerobridge.prepare(model, stage=3)
    twin = host_world()
    return {"rank": dist.get_rank(), "current": torch.cuda.current_device(), "backend": dist.get_backend(),
            "twin_gloo": dist.get_backend(twin) == "gloo", "host_on_default": carries_host()}


def test_each_rank_binds_its_own_gpu() -> None:
    world = min(GPUS, 2)
    with Cluster(world, backend="nccl", env=NCCL) as cluster:
        for got in cluster.run(f"{ME}:bound_devices"):
            assert got["current"] == got["rank"] and got["backend"] == "nccl"
            assert got["twin_gloo"] and not got["host_on_default"]


@pytest.mark.skipif(GPUS < 2, reason="parity across ranks needs two GPUs")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_gpus_match_the_reference(stage: int) -> None:
    with Cluster(2, backend="nccl", env=NCCL) as cluster:
        results = cluster.run(NATIVE, stage=stage, steps=6)
    assert results[0].losses == results[1].losses
    close_to(results[0], run_reference(steps=6))


@pytest.mark.skipif(GPUS < 2, reason="a quantized collective needs two ranks")
@pytest.mark.parametrize("wire", [{"param_gather": "int8", "grad_reduce": "int4"}, {"param_gather": "fp8"},
                                  {"param_gather": "int8", "frozen_weights": "int8"}],
                         ids=["qwz+qgz", "fp8", "frozen-int8"])
def test_quantized_collectives_on_nccl(wire: dict[str, str]) -> None:
    """The same encoded gathers and all-to-all reductions as on gloo, through NCCL: ranks agree and the
    run stays within the format's bound of the exact one (tests/test_engine_wire.py's bounds)."""
    from zerobridge.spec import StrategySpec
    from zerobridge.spec.presets import spec_for_stage

    data = spec_for_stage(3).model_dump(mode="json")
    exact = StrategySpec.model_validate(data)
    data["communication"]["wire"] = wire
    quantized = StrategySpec.model_validate(data)
    with Cluster(2, backend="nccl", env=NCCL) as cluster:
        ref = cluster.run(NATIVE, spec=exact, steps=4, clip=None)[0]
        runs = cluster.run(NATIVE, spec=quantized, steps=4, clip=None)
    assert runs[0].losses == runs[1].losses
    bound = 0.05 if "int4" in wire.values() else 0.02
    assert max(abs(a - b) / abs(b) for a, b in zip(runs[0].losses, ref.losses)) < bound
    assert runs[0].stats[-1]["comm_bytes"].get("all_gather", 0) < ref.stats[-1]["comm_bytes"]["all_gather"]
