"""One entry point for "a strategy, however the user names it".

    >>> from zerobridge.loading import load
    >>> load("zero2-offload").value.offload.optimizer.device.value
    'cpu'

A path to a DeepSpeed JSON, Accelerate YAML, FSDP kwargs JSON, torchtitan
TOML or spec file; a registry name or alias; a Lightning strategy name; an
Accelerate sharding code; a dict in DeepSpeed form; or a spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import read, read_file
from zerobridge.translate.report import Report, Translation
from zerobridge.translate.sources import Located

__all__ = ["load"]

_FILE_SUFFIXES = (".json", ".hjson", ".jsonc", ".yaml", ".yml", ".toml")


def load(source: str | Path | dict[str, Any] | StrategySpec, *, fmt: str | None = None) -> Translation[StrategySpec]:
    """The spec ``source`` means, with the report of how it was read."""
    if isinstance(source, StrategySpec):
        return Translation(source, Report(source="spec", target="spec"))
    if isinstance(source, dict):
        return read(Located(source, "<dict>"), fmt or "deepspeed")
    path = Path(source)
    if path.exists() or str(source).lower().endswith(_FILE_SUFFIXES) or "/" in str(source):
        return read_file(path, fmt)
    if fmt is not None:
        raise ConfigError(f"--from {fmt} needs a file, got the name {str(source)!r}", source=str(source))
    from zerobridge.registry import resolve

    return resolve(str(source))
