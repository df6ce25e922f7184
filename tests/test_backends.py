"""Choosing a backend: the argument, then ``$ZEROBRIDGE_BACKEND``, then native; bad names are clear errors."""

from __future__ import annotations

import pytest
import torch

import zerobridge
from zerobridge.backends.base import backend_of
from zerobridge.env import resolve_backend
from zerobridge.errors import ConfigError


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
