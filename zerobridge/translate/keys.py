"""Shared helpers for translators that read a nested source through a ``mappings/`` table.

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.translate.keys import spec_diff, update_spec
    >>> spec = StrategySpec()
    >>> spec_diff(spec, update_spec(spec, {"sharding.world_size": 8}))
    [('sharding.world_size', None, 8)]

``SourceKeys`` resolves a source's keys (Accelerate YAML, torchtitan TOML,
Lightning constructor arguments) to the canonical paths of its mapping table,
coerces and reports them; ``update_spec`` applies dotted-path changes to a
spec and validates it again; ``chain_report`` merges a delegate reader's report
under the source's own key names; ``spec_diff`` lists the fields a written
config does not reproduce, for the writers' reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from zerobridge.errors import closest, from_validation_error
from zerobridge.spec import AUTO, StrategySpec, is_auto
from zerobridge.translate.mapping import MappingTable
from zerobridge.translate.report import Report, Status
from zerobridge.translate.sources import Located
from zerobridge.translate.values import as_float, as_int

__all__ = ["FALSY", "TRUTHY", "SourceKeys", "chain_report", "join_notes", "spec_diff", "update_spec"]

TRUTHY, FALSY = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")
"""The spellings Accelerate's ``str_to_bool`` reads as true and as false."""


class SourceKeys:
    """A nested source's keys resolved through a mapping table (canonical path -> value).

    Passthrough keys are carried verbatim; an unknown key in one of the table's
    strict sections is a ``ConfigError`` naming the closest known key, elsewhere
    it is carried with a note. ``normalize(prefix, key)`` renames keys the way
    the consumer does before lookup (Accelerate adds ``fsdp_`` in fsdp_config).
    """

    def __init__(self, located: Located, table: MappingTable, report: Report, *, consumer: str,
                 normalize: Callable[[str, str], str] | None = None) -> None:
        self.located, self.table, self.report, self.consumer = located, table, report, consumer
        self.values: dict[str, Any] = {}
        self.given_as: dict[str, str] = {}
        self.carried: dict[str, Any] = {}
        self._normalize = normalize or (lambda prefix, key: key)
        self._walk("", located.data)

    def _walk(self, prefix: str, obj: dict[str, Any]) -> None:
        for raw, value in obj.items():
            path = ".".join(p for p in (prefix, self._normalize(prefix, str(raw))) if p)
            spelled = ".".join(p for p in (prefix, str(raw)) if p)
            row = self.table.find(path)
            if row is not None and row.type != "section" and (row.type == "structural" or not isinstance(value, dict)):
                if row.path in self.values:
                    raise self.located.error(f"given twice, as {self.given_as[row.path]!r} and {spelled!r}",
                                             key=spelled, fix="keep one of them")
                self.values[row.path], self.given_as[row.path] = value, spelled
            elif self.table.is_passthrough(path):
                self.carried[path] = value
                self.report.add(spelled, Status.NOT_ABOUT_SHARDING, "not a sharding setting: carried verbatim")
            elif self.table.children(path) and (isinstance(value, dict) or value is None):
                self._walk(path, value or {})
            else:
                self._unknown(prefix, spelled, str(raw), value)

    def _unknown(self, prefix: str, spelled: str, key: str, value: Any) -> None:
        known = self.table.children(prefix)
        where = f"in {prefix!r}" if prefix else "at the top level"
        if prefix in self.table.strict_sections:
            match = closest(key, known)
            fix = f"did you mean {match!r}?" if match else f"valid keys {where}: {', '.join(known)}"
            raise self.located.error(f"unknown key {key!r} {where}", key=spelled, fix=fix)
        self.carried[".".join(p for p in (prefix, key) if p)] = value
        self.report.add(spelled, Status.NOT_ABOUT_SHARDING, f"not a {self.consumer} setting zerobridge knows: carried")

    def given(self, path: str) -> bool:
        return path in self.values

    def key(self, path: str) -> str:
        """``path`` as the source spelled it."""
        return self.given_as.get(path, path)

    def get(self, path: str) -> Any:
        """The value at canonical ``path``, coerced by the row's type, or the row's default."""
        row = self.table.row(path)
        if path not in self.values:
            return row.default if row.has_default else None
        value, key, loc = self.values[path], self.key(path), self.located
        if row.auto and is_auto(value):
            return AUTO
        if row.type == "int":
            return as_int(loc, key, value, minimum=None)
        if row.type == "float":
            return as_float(loc, key, value)
        if row.type == "bool":
            return self.flag(path)
        if row.type == "enum":
            text = "no" if value is False and "no" in row.values else str(value)
            for choice in row.values:
                if choice.lower() == text.lower():
                    return choice
            match = closest(text, row.values)
            raise loc.error(f"expected one of {', '.join(row.values)}, got {value!r}", key=key,
                            fix=f"did you mean {match!r}?" if match else None)
        return value

    def flag(self, path: str, default: Any = None) -> bool:
        """A boolean the way Accelerate's ``str_to_bool`` reads one (yes/no/on/off/1/0 count)."""
        value = self.values.get(path, self.carried.get(path, default))
        text = str(value).lower()
        if text in TRUTHY or text in FALSY:
            return text in TRUTHY
        raise self.located.error(f"expected true or false, got {value!r}", key=self.key(path))

    def note(self, path: str, status: Status | None = None, extra: str = "", *, target: str = "") -> None:
        """Report ``path`` (as spelled) with its table note, or its default when absent."""
        row = self.table.row(path)
        if path not in self.values:
            if row.has_default:
                self.report.add(path, status or Status.DEFAULT,
                                join_notes(f"absent: {self.consumer} default {row.default!r}", extra),
                                target=target or row.spec)
            return
        if row.auto and is_auto(self.values[path]):
            self.report.add(self.key(path), Status.AUTO, join_notes("kept as \"auto\": filled at run time", extra),
                            target=target or row.spec)
            return
        deprecated = f"deprecated, read as {row.deprecated}; " if row.deprecated else ""
        self.report.add(self.key(path), status or row.status, join_notes(deprecated + row.note, extra),
                        target=target or row.spec)

    def note_rest(self) -> None:
        """Report every given key not reported yet; a switch that is off changes nothing."""
        for path in self.values:
            if self.report.find(self.key(path)) is None:
                off = self.table.row(path).type == "bool" and self.values[path] in (False, "false", "False")
                self.note(path, Status.EXACT if off else None, "off" if off else "")

    def passthrough(self) -> dict[str, Any]:
        """The carried keys as nested data."""
        out: dict[str, Any] = {}
        for path, value in self.carried.items():
            node = out
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return out


def join_notes(*parts: str) -> str:
    """The non-empty ``parts`` as one report note."""
    return "; ".join(p for p in parts if p)


def update_spec(spec: StrategySpec, changes: dict[str, Any], *, source: str = "") -> StrategySpec:
    """``spec`` with dotted-path fields replaced, validated again."""
    data = spec.model_dump()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    try:
        return StrategySpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, source=source or None) from None


def spec_diff(want: StrategySpec, got: StrategySpec) -> list[tuple[str, Any, Any]]:
    """Leaf fields (dotted) where ``got`` differs from ``want``, passthrough left out."""
    out: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and a.get("kind") == b.get("kind") \
                and a.get("policy") == b.get("policy"):
            for k in a:
                walk(f"{prefix}.{k}" if prefix else k, a[k], b.get(k))
        elif a != b:
            out.append((prefix, a, b))

    a, b = want.model_dump(mode="json"), got.model_dump(mode="json")
    a.pop("passthrough"), b.pop("passthrough")
    walk("", a, b)
    return out


def chain_report(report: Report, other: Report, rename: dict[str, str], label: str) -> None:
    """Chain a delegate's report, its keys renamed to the YAML keys they came from."""
    for e in other.entries:
        head = next((y for j, y in rename.items() if e.key == j or j.endswith(".") and e.key.startswith(j)), None)
        key = head or f"{e.key} ({label})"
        if not any(old.key == key and old.target == e.target for old in report.entries):
            report.add(key, e.status, e.note, target=e.target)
