"""Every ``ZEROBRIDGE_*`` environment variable: its name, its grammar, and how a value is read.

    >>> from zerobridge.env import decode_choice, encode_choice, resolve_backend, resolve_compile
    >>> encode_choice(config=None, stage=3, strategy=None)
    'stage:3'
    >>> decode_choice("strategy:zero2-offload")
    ('strategy', 'zero2-offload')
    >>> decode_choice("1")
    ('stage', 1)
    >>> resolve_backend(None, env={"ZEROBRIDGE_BACKEND": "fsdp"})
    'fsdp'
    >>> resolve_compile(None, env={}), resolve_compile(None, env={"ZEROBRIDGE_COMPILE": "1"})
    (None, True)

``zerobridge run`` sets them for its workers; ``zerobridge.prepare`` reads
them when its own arguments leave a choice open. ``ZEROBRIDGE_CONFIG``
carries the strategy in one of three forms:

    ``stage:N``            a ZeRO stage, N in 0..3
    ``strategy:NAME``      a registry name or alias (``zerobridge strategies``)
    ``config:/abs/path``   a config file (DeepSpeed JSON, Accelerate YAML, ...)

A bare value is read as a config when it names an existing file, as a stage
when it is an integer 0..3, and as a strategy name otherwise.

Torch-free, so the launcher and the CLI read it without loading torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from zerobridge.errors import ConfigError
from zerobridge.spec.presets import STAGES

__all__ = ["ALLOW_APPROXIMATE", "BACKEND", "BACKENDS", "COMPILE", "CONFIG", "PREPARED", "TEST_DEVICE", "TIMEOUT",
           "ChoiceKind", "choice_from_env", "decode_choice", "encode_choice", "env_flag", "mark_prepared",
           "resolve_allow_approximate", "resolve_backend", "resolve_compile"]

CONFIG = "ZEROBRIDGE_CONFIG"
"""The strategy the launcher chose (the grammar above)."""
BACKEND = "ZEROBRIDGE_BACKEND"
"""The engine ``prepare`` runs on when its ``backend`` argument is not given."""
ALLOW_APPROXIMATE = "ZEROBRIDGE_ALLOW_APPROXIMATE"
"""``1``: run what a backend cannot express exactly as its closest form (``zerobridge run --allow-approximate``)."""
COMPILE = "ZEROBRIDGE_COMPILE"
"""``1``/``0``: compile the model's units, or not, whatever the spec says (``zerobridge run --compile``)."""
TIMEOUT = "ZEROBRIDGE_TIMEOUT"
"""Seconds a collective waits for its peers (default: the default group's own timeout)."""
PREPARED = "ZEROBRIDGE_PREPARED"
"""A file ``zerobridge run`` names for its workers and ``prepare`` creates (``mark_prepared``): when the
script exits without it, the launcher warns that the strategy and backend it passed were never used."""
TEST_DEVICE = "ZEROBRIDGE_TEST_DEVICE"
"""``cuda``: the test harness runs its process groups on GPUs with NCCL (``make test-gpu``)."""

BACKENDS = ("native", "fsdp", "deepspeed")
"""The engines a model can be prepared on."""

ChoiceKind = Literal["stage", "strategy", "config"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _stage(text: str | int, key: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"a ZeRO stage is an integer 0-3, got {text!r}", key=key) from None
    if value not in STAGES:
        raise ConfigError(f"a ZeRO stage is 0, 1, 2 or 3, got {value}", key=key)
    return value


def encode_choice(*, config: str | os.PathLike[str] | None, stage: int | None, strategy: str | None) -> str | None:
    """The ``ZEROBRIDGE_CONFIG`` value for one choice; None when nothing was chosen.

    Config paths are made absolute, so workers started in another directory
    find the same file.
    """
    given = [flag for flag, value in (("--config", config), ("--stage", stage), ("--strategy", strategy))
             if value is not None]
    if len(given) > 1:
        raise ConfigError(f"choose one of --config, --stage and --strategy, not {' and '.join(given)}",
                          fix="keep one; a config file or strategy name already fixes the stage")
    if config is not None:
        return f"config:{os.path.abspath(os.path.expanduser(os.fspath(config)))}"
    if stage is not None:
        return f"stage:{_stage(stage, '--stage')}"
    if strategy is not None:
        if not strategy.strip():
            raise ConfigError("--strategy needs a name", fix="`zerobridge strategies` lists the names")
        return f"strategy:{strategy.strip()}"
    return None


def decode_choice(value: str) -> tuple[ChoiceKind, str | int]:
    """``("stage", 3)``, ``("strategy", "zero3")`` or ``("config", "/abs/path.json")``."""
    text = value.strip()
    kind, sep, rest = text.partition(":")
    if sep and kind in ("stage", "strategy", "config"):
        rest = rest.strip()
        if not rest:
            raise ConfigError(f"{kind!r} needs a value after the colon, got {value!r}", key=CONFIG)
        if kind == "stage":
            return "stage", _stage(rest, CONFIG)
        if kind == "config":
            return "config", os.path.abspath(os.path.expanduser(rest))
        return "strategy", rest
    if not text:
        raise ConfigError("empty value", key=CONFIG, fix="use stage:N, strategy:NAME or config:/path")
    if os.path.isfile(os.path.expanduser(text)):
        return "config", os.path.abspath(os.path.expanduser(text))
    if text.isdigit() and int(text) in STAGES:
        return "stage", int(text)
    return "strategy", text


def choice_from_env(environ: Mapping[str, str] | None = None) -> tuple[ChoiceKind, str | int] | None:
    """The decoded ``ZEROBRIDGE_CONFIG`` of this process (or ``environ``); None when unset or empty."""
    value = (os.environ if environ is None else environ).get(CONFIG, "")
    return decode_choice(value) if value.strip() else None


def resolve_backend(given: str | None, *, env: Mapping[str, str] | None = None) -> str:
    """The backend: the argument, else ``$ZEROBRIDGE_BACKEND``, else ``native``."""
    environ = os.environ if env is None else env
    value = given if given is not None else environ.get(BACKEND) or "native"
    if value not in BACKENDS:
        source = "backend" if given is not None else BACKEND
        raise ConfigError(f"{source}={value!r} is not a backend", key=source,
                          fix=f"choose one of {', '.join(BACKENDS)}")
    return value


def resolve_allow_approximate(given: bool | None, *, env: Mapping[str, str] | None = None) -> bool:
    """The argument, else ``$ZEROBRIDGE_ALLOW_APPROXIMATE`` (``zerobridge run --allow-approximate``
    sets it to 1), else False."""
    return given if given is not None else bool(env_flag(ALLOW_APPROXIMATE, env))


def resolve_compile(given: bool | None, *, env: Mapping[str, str] | None = None) -> bool | None:
    """Whether to compile: the argument, else ``$ZEROBRIDGE_COMPILE`` (``zerobridge run --compile``
    sets it to 1), else ``None`` (the spec's ``compile.enabled`` decides)."""
    return given if given is not None else env_flag(COMPILE, env)


def mark_prepared(env: Mapping[str, str] | None = None) -> None:
    """Create the file ``$ZEROBRIDGE_PREPARED`` names, when set: this process read the launcher's
    choice (``zerobridge.prepare`` calls it first, and so should any other entry point that reads
    ``ZEROBRIDGE_CONFIG`` / ``ZEROBRIDGE_BACKEND``). A file that cannot be written is passed over: the
    marker only feeds the launcher's warning, never fails training."""
    path = (os.environ if env is None else env).get(PREPARED, "")
    if path:
        try:
            with open(path, "a", encoding="ascii"):
                pass
        except OSError:
            pass


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """A yes/no environment variable; ``None`` when it is unset."""
    environ = os.environ if env is None else env
    if name not in environ:
        return None
    value = environ[name].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a yes/no value", key=name, fix="set it to 1 or 0, or unset it")
