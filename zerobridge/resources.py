"""Where the data directories ``strategies/`` and ``mappings/`` are.

In a source checkout they sit beside the package; in an installed wheel they
ship inside it as ``zerobridge/_data/``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

__all__ = ["data_dir"]

_PACKAGE = Path(__file__).resolve().parent


@cache
def data_dir(name: Literal["strategies", "mappings"]) -> Path:
    """The directory holding the shipped data files called ``name``."""
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"zerobridge's data directory {name!r} is missing: reinstall the package "
        "(pip install zerobridge) or run from a complete source checkout"
    )
