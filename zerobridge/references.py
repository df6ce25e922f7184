"""``pkg.module:function`` references, as ``--model`` and ``MODEL`` take them.

    >>> from zerobridge.references import resolve_callable
    >>> resolve_callable("os.path:join", key="--model", wants="a function")("a", "b")
    'a/b'
    >>> resolve_callable("os.path:nope", key="--model", wants="a function returning a model")
    Traceback (most recent call last):
    ...
    zerobridge.errors.ConfigError: --model: module 'os.path' has no attribute 'nope'
      fix: name a function returning a model
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from zerobridge.errors import ConfigError

__all__ = ["resolve_callable"]


def resolve_callable(ref: str, *, key: str, wants: str) -> Callable[..., object]:
    """The callable ``ref`` (``pkg.module:attr.attr``) names; ``ConfigError`` at ``key`` otherwise,
    whose fix asks for ``wants``."""
    head, _, tail = ref.partition(":")
    try:
        obj: object = importlib.import_module(head)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {head!r}: {exc}", key=key,
                          fix="check the name, and that the module is on PYTHONPATH (on every rank)") from None
    for part in tail.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {head!r} has no attribute {tail!r}", key=key, fix=f"name {wants}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{ref!r} is not callable", key=key, fix=f"name {wants}")
    return obj
