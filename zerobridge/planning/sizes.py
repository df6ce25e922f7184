"""Memory sizes as people write them: ``80GiB``, ``80GB``, ``1.5TiB``, ``512MiB`` or plain bytes.

    >>> from zerobridge.planning.sizes import parse_bytes
    >>> parse_bytes("80GiB"), parse_bytes("80GB"), parse_bytes("1.5 TiB"), parse_bytes(4096)
    (85899345920, 80000000000, 1649267441664, 4096)
    >>> parse_bytes("80 gigs")
    Traceback (most recent call last):
    ...
    zerobridge.errors.ConfigError: --memory: '80 gigs' is not a memory size
      fix: write a number and a unit: 80GiB, 80GB, 512MiB, 1TiB (or plain bytes)

``GiB`` and friends are powers of 1024, ``GB`` powers of 1000 (as GPU
datasheets mix them: an "80GB" H100 holds 79.6 GiB a process can allocate).
"""

from __future__ import annotations

import re

from zerobridge.errors import ConfigError

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, key: str = "--memory") -> int:
    """Bytes in ``value``; ``ConfigError`` naming ``key`` and the accepted forms otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{value} bytes: a memory size must be positive", key=key, fix="e.g. 80GiB")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{value!r} is not a memory size", key=key,
                          fix="write a number and a unit: 80GiB, 80GB, 512MiB, 1TiB (or plain bytes)")
    size = round(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{value!r}: a memory size must be positive", key=key, fix="e.g. 80GiB")
    return size
