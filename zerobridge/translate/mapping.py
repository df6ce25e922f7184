"""Key tables in ``mappings/``: which source key becomes which spec field.

Each table is a TOML file with one ``[[key]]`` row per source key:

    path     = "zero_optimization.reduce_bucket_size"   # canonical key path
    aliases  = ["zero_optimization.stage3_..."]          # other accepted names
    spec     = "communication.reduce_bucket"             # spec field, or ""
    type     = "int"        # int | float | bool | str | enum | dtype | section | structural
    default  = 500000000    # the source's own default (absent: none)
    auto     = true         # whether "auto" is accepted
    status   = "exact"      # how reading it maps (a report Status)
    note     = "..."        # what the report and docs say
    deprecated = "..."      # for legacy names: what replaces it

A ``section`` row is an object whose keys have rows of their own, a
``structural`` one takes any value whole (lists, objects), every other type a
single value. ``keys.SourceKeys`` reads a source through its table for
validation, aliases, defaults and notes; the docs generator renders the same
rows, so docs and code cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import tomllib

from zerobridge.resources import data_dir
from zerobridge.translate.report import Status

__all__ = ["MappingTable", "Row", "load_table", "table_names"]

_NO_DEFAULT = object()


@dataclass(frozen=True)
class Row:
    """One source key."""

    path: str
    spec: str
    type: str
    status: Status
    note: str
    aliases: tuple[str, ...] = ()
    default: Any = _NO_DEFAULT
    auto: bool = False
    deprecated: str = ""
    values: tuple[str, ...] = ()

    @property
    def has_default(self) -> bool:
        """Whether the source defines a default for this key."""
        return self.default is not _NO_DEFAULT

    @property
    def names(self) -> tuple[str, ...]:
        """The canonical path followed by its aliases."""
        return (self.path, *self.aliases)


@dataclass(frozen=True)
class MappingTable:
    """All rows of one format, plus its carried-through sections."""

    format: str
    title: str
    rows: tuple[Row, ...]
    passthrough: tuple[str, ...]
    """Key paths that are not about sharding and are carried verbatim."""
    strict_sections: tuple[str, ...]
    """Sections where the consumer rejects unknown keys."""
    removed: dict[str, str] = field(default_factory=dict, compare=False)
    """Key paths the consumer has removed and rejects, with what became of each: read
    (and reported as ignored) from older sources, never written."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """How files of this format are read and written beyond the key rows (docs/translators.md)."""
    named: tuple[dict[str, Any], ...] = field(default=(), compare=False)
    """The table's ``[[strategy]]`` rows: names the format's users type and
    the arguments each stands for (Lightning's strategy registry)."""

    def find(self, path: str) -> Row | None:
        """The row whose path or alias is ``path``."""
        return self._index().get(path)

    def row(self, path: str) -> Row:
        """The row for canonical ``path``; a missing row is a bug in the table."""
        row = self.find(path)
        assert row is not None, f"mappings/{self.format}.toml has no row {path!r}"
        return row

    def children(self, section: str) -> list[str]:
        """Every known name directly under ``section`` ("" for top level)."""
        prefix = f"{section}." if section else ""
        names = {name[len(prefix):].split(".")[0] for name in self._index() if name.startswith(prefix)}
        names.update(p[len(prefix):].split(".")[0] for p in (*self.passthrough, *self.removed) if p.startswith(prefix))
        return sorted(names)

    def is_passthrough(self, path: str) -> bool:
        """Whether ``path`` lies in a carried-through section."""
        return any(path == p or path.startswith(f"{p}.") for p in self.passthrough)

    @cache  # noqa: B019 - tables are immortal module-level singletons
    def _index(self) -> dict[str, Row]:
        return {name: row for row in self.rows for name in row.names}


def _row(raw: dict[str, Any], fmt: str) -> Row:
    try:
        return Row(
            path=raw["path"],
            spec=raw.get("spec", ""),
            type=raw.get("type", "structural"),
            status=Status(raw.get("status", "exact")),
            note=raw.get("note", ""),
            aliases=tuple(raw.get("aliases", ())),
            default=_frozen(raw.get("default", _NO_DEFAULT)),
            auto=bool(raw.get("auto", False)),
            deprecated=raw.get("deprecated", ""),
            values=tuple(raw.get("values", ())),
        )
    except (KeyError, ValueError) as exc:  # a broken shipped table is a bug
        raise RuntimeError(f"mappings/{fmt}.toml: bad row {raw!r}: {exc}") from exc


def _frozen(value: Any) -> Any:
    """A list default as a tuple: rows are hashable."""
    return tuple(value) if isinstance(value, list) else value


@cache
def load_table(fmt: str) -> MappingTable:
    """The table ``mappings/<fmt>.toml``."""
    path = data_dir("mappings") / f"{fmt}.toml"
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    return MappingTable(
        format=fmt,
        title=raw.get("title", fmt),
        rows=tuple(_row(r, fmt) for r in raw.get("key", ())),
        passthrough=tuple(raw.get("passthrough", ())),
        strict_sections=tuple(raw.get("strict_sections", ())),
        removed=dict(raw.get("removed", {})),
        notes=tuple(raw.get("notes", ())),
        named=tuple(raw.get("strategy", ())),
    )


def table_names() -> list[str]:
    """Every shipped table, by format name."""
    return sorted(p.stem for p in data_dir("mappings").glob("*.toml"))
