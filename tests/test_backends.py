"""Choosing a backend: the argument, then ``$ZEROBRIDGE_BACKEND``, then native; bad names are clear errors."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch

import zerobridge
from zerobridge import api
from zerobridge.backends.base import backend_of
from zerobridge.env import resolve_backend
from zerobridge.errors import ConfigError


@pytest.fixture(autouse=True, scope="module")
def _leave_no_process_group() -> Iterator[None]:
    """``prepare`` under plain python starts a one-rank group in this process; the modules after this one
    must not inherit it (a plan, for one, runs rank 0 of a fake group of its own)."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_argument_wins_over_environment() -> None:
    assert resolve_backend("deepspeed", env={"ZEROBRIDGE_BACKEND": "fsdp"}) == "deepspeed"
    assert resolve_backend(None, env={"ZEROBRIDGE_BACKEND": "deepspeed"}) == "deepspeed"
    assert resolve_backend(None, env={"ZEROBRIDGE_BACKEND": ""}) == "native"


@pytest.mark.parametrize(("given", "env", "key"), [
    ("fsdp1x", {}, "backend"), (None, {"ZEROBRIDGE_BACKEND": "torch"}, "ZEROBRIDGE_BACKEND"),
])
def test_unknown_backend_names_the_source_and_the_choices(given: str | None, env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_backend(given, env=env)
    assert caught.value.key == key and "native, fsdp, deepspeed" in (caught.value.fix or "")


def test_prepare_refuses_an_unknown_backend_before_touching_the_model() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="'ddp' is not a backend"):
        zerobridge.prepare(model, stage=1, backend="ddp")
    with pytest.raises(ConfigError, match="was not prepared"):
        backend_of(model)


def test_a_model_prepared_by_any_backend_is_refused_a_second_time() -> None:
    from zerobridge.backends.base import set_backend
    from zerobridge.backends.native.backend import NativeBackend

    model = torch.nn.Linear(2, 2)
    set_backend(model, NativeBackend.__new__(NativeBackend))  # as a foreign backend leaves it: no ZeroModule class
    with pytest.raises(ConfigError, match="already prepared"):
        zerobridge.prepare(model, stage=0)


@pytest.fixture
def own_environ() -> Iterator[None]:
    """DeepSpeed's in-process start sets RANK, WORLD_SIZE, LOCAL_RANK (and no MASTER_ADDR): later tests would
    read them as a launcher's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("backend", ["native", "fsdp", "deepspeed"])
def test_accumulation_boundary_is_public_and_steps_the_schedule_once_per_window(backend: str, own_environ: None
                                                                                 ) -> None:
    """The natural port of a DeepSpeed loop: step the optimizer and the scheduler only at a boundary."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3}}
    model, optimizer = zerobridge.prepare(model, optimizer, config=config, backend=backend)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    boundaries, lrs = [], []
    assert not zerobridge.is_accumulation_boundary(model)  # the first micro-step of a window does not close it
    for _ in range(6):
        model(torch.randn(1, 4)).sum().backward()
        boundaries.append(zerobridge.is_accumulation_boundary(model))
        if boundaries[-1]:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert boundaries == [False, True] * 3
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.1 / 3, 0.1 / 3, 0.025])


def test_prepare_warns_once_that_config_sections_are_not_applied() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    api._WARNED.discard("scheduler")
    with pytest.warns(UserWarning, match="zerobridge.deepspeed"):
        zerobridge.prepare(torch.nn.Linear(2, 2), config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        zerobridge.prepare(torch.nn.Linear(2, 2), config=config)
