"""One entry point for "a strategy, however the user names it".

    >>> from zerobridge.load import load_spec
    >>> load_spec("zero2-offload").value.offload.optimizer.device.value
    'cpu'

A path to a DeepSpeed JSON, Accelerate YAML, FSDP kwargs JSON, torchtitan
TOML or spec file; a registry name or alias; a Lightning strategy name; an
Accelerate sharding code; a dict in DeepSpeed form; or a spec.

It sits beside ``registry.py``, above ``translate/``: it resolves names through
the registry, which reads its entries through the translators, so inside
``translate/`` it would close a package cycle (translate -> registry ->
translate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.registry import resolve
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import read, read_file
from zerobridge.translate.report import Report, Translation
from zerobridge.translate.sources import Located

__all__ = ["load_spec"]

_FILE_SUFFIXES = (".json", ".hjson", ".jsonc", ".yaml", ".yml", ".toml", ".sh", ".bash", ".args", ".flags", ".txt")


def load_spec(source: str | Path | dict[str, Any] | StrategySpec, *,
              fmt: str | None = None) -> Translation[StrategySpec]:
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
    return resolve(str(source))
