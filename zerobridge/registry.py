"""The strategy registry: named strategies stored as data in ``strategies/``.

    >>> from zerobridge.registry import resolve, strategies
    >>> resolve("zero3").value.sharding.stage.value
    3
    >>> resolve("fsdp:SHARD_GRAD_OP").value.sharding.parameters.value
    'reshard_after_backward'
    >>> len(strategies()) >= 20
    True

Each file states a strategy the way its own flavor writes it (a DeepSpeed
``zero_optimization`` block, FSDP kwargs) and is read through that flavor's
translator, so ``zero3`` means exactly what DeepSpeed does with ``stage: 3``
and its defaults. Names users type elsewhere resolve too: Lightning strategy
names (``deepspeed_stage_2_offload``, ``fsdp_cpu_offload``), Accelerate's
FSDP sharding-strategy codes 1-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from zerobridge.errors import ConfigError, closest
from zerobridge.resources import data_dir
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import read
from zerobridge.translate.lightning import lightning_names, read_lightning
from zerobridge.translate.report import Translation
from zerobridge.translate.run_level import leave_to_script
from zerobridge.translate.sources import Located

__all__ = ["ACCELERATE_CODES", "Strategy", "names", "resolve", "strategies"]

ACCELERATE_CODES: dict[str, str] = {
    "1": "fsdp-full-shard", "2": "fsdp-shard-grad-op", "3": "fsdp-no-shard",
    "4": "fsdp-hybrid-shard", "5": "fsdp-hybrid-shard-zero2",
}
"""Accelerate's ``fsdp_sharding_strategy`` integer codes."""


@dataclass(frozen=True)
class Strategy:
    """One registry entry."""

    name: str
    aliases: tuple[str, ...]
    title: str
    description: str
    source_format: str
    source_config: dict[str, Any]
    file: Path

    def spec(self) -> Translation[StrategySpec]:
        """The spec this entry means, read through its flavor's translator. A name states
        only how state is sharded: batch size, accumulation, clipping and precision are
        left to the training script (``"auto"``)."""
        translation = read(Located(self.source_config, str(self.file)), self.source_format)
        report = translation.report
        spec = leave_to_script(translation.value, report, consumer=f"the name {self.name!r}", precision=True)
        return Translation(spec.model_copy(update={"name": self.name}), report)


def _entry(path: Path) -> Strategy:
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    source = raw["source"]
    return Strategy(name=raw["name"], aliases=tuple(raw.get("aliases", ())), title=raw["title"],
                    description=raw.get("description", ""), source_format=source["format"],
                    source_config=source.get("config", {}), file=path)


@cache
def strategies() -> tuple[Strategy, ...]:
    """Every registry entry, sorted by name."""
    entries = [_entry(p) for p in data_dir("strategies").glob("*.toml")]
    return tuple(sorted(entries, key=lambda s: s.name))


@cache
def _index() -> dict[str, Strategy]:
    index: dict[str, Strategy] = {}
    for entry in strategies():
        for name in (entry.name, *entry.aliases):
            key = _key(name)
            assert key not in index, f"strategies/: {name!r} is claimed twice"
            index[key] = entry
    for code, name in ACCELERATE_CODES.items():
        index[code] = index[_key(name)]
    return index


def _key(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    if ":" in key:
        flavor, _, rest = key.partition(":")
        key = f"{flavor}:{rest.lstrip('-')}"
    return key


def names() -> list[str]:
    """Every name and alias that resolves, including Lightning's."""
    own = [n for entry in strategies() for n in (entry.name, *entry.aliases)]
    return own + list(ACCELERATE_CODES) + lightning_names()


def resolve(name: str) -> Translation[StrategySpec]:
    """The spec a strategy name means: a registry name or alias, an
    Accelerate code, or a Lightning strategy name (``lightning:`` optional)."""
    entry = _index().get(_key(name))
    if entry is not None:
        return entry.spec()
    bare = name.removeprefix("lightning:")
    if bare in lightning_names():
        return read_lightning(bare)
    match = closest(name, names())
    raise ConfigError(f"{name!r} is neither a file nor a strategy name",
                      fix=(f"did you mean {match!r}? " if match else "") + "`zerobridge strategies` lists the names")
