"""Reading a nested source through its ``mappings/`` table, and the helpers the readers share.

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.translate.keys import spec_diff, update_spec
    >>> spec = StrategySpec()
    >>> spec_diff(spec, update_spec(spec, {"sharding.world_size": 8}))
    [('sharding.world_size', None, 8)]

``SourceKeys`` is the key reader of every translator (DeepSpeed JSON, the FSDP
JSON forms, Accelerate YAML, torchtitan TOML, Lightning arguments). It walks
the source through its mapping table once: aliases resolve to canonical paths,
passthrough keys are carried, an unknown key in a strict section is an error
naming the closest valid key. Afterwards it coerces values by the row's type
and reports keys with the row's note. How the consumers differ (how they read
booleans, whether they ignore unknown top-level keys, how they rename keys) is
given as constructor options; what a setting means stays in the format's
module. ``from_validation_error`` turns the first problem of a spec's pydantic
error into a ``ConfigError`` naming the key (it knows the spec's union tags,
which ``zerobridge.errors``, the bottom layer, must not); ``update_spec``
applies dotted-path changes to a spec and validates it again;
``chain_report`` merges a delegate reader's report under the source's own key
names; ``spec_diff`` lists the fields a written config does not reproduce, for
the writers' reports.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from zerobridge.errors import ConfigError, closest
from zerobridge.spec import (
    AUTO,
    DynamicLossScale,
    EveryModuleWrap,
    NoLossScale,
    RootWrap,
    SizeWrap,
    StaticLossScale,
    StrategySpec,
    TransformerWrap,
    is_auto,
)
from zerobridge.translate.mapping import MappingTable, Row
from zerobridge.translate.report import Report, Status
from zerobridge.translate.sources import Located
from zerobridge.translate.values import as_bool, as_dtype, as_float, as_int

__all__ = [
    "FALSY", "TRUTHY", "SourceKeys", "chain_report", "from_validation_error", "join_notes", "spec_diff", "update_spec",
]

TRUTHY, FALSY = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")
"""The spellings Accelerate's ``str_to_bool`` reads as true and as false."""


class SourceKeys:
    """A nested source's keys resolved through its mapping table: canonical path -> value.

    Construction walks the source once. A ``section`` row is an object whose
    keys have rows of their own (its value is kept too), a ``structural`` row
    takes any value whole, every other row a single value; passthrough keys are
    carried; an unknown key in a strict section is an error naming the closest
    known key. How the consumers differ is given as options:

    - ``consumer``: the program that reads the source, named in messages and notes.
    - ``bools``: ``"strict"`` reads JSON booleans and the strings true/false;
      ``"accelerate"`` reads them as Accelerate's ``str_to_bool`` does (yes/no/on/off/1/0 too).
    - ``top_level_typos``: ``"error"`` for a consumer that silently ignores unknown
      top-level keys: a near miss of a known key is refused, other unknown keys are
      carried with a note saying the consumer ignores them, and unknown-key errors
      say which rule applied; ``"carry"``: unknown keys outside strict sections are carried.
    - ``normalize(prefix, key)``: the key the consumer looks up (Accelerate adds
      ``fsdp_`` in fsdp_config).
    - ``null_is_empty``: a null where a section belongs reads as an empty section
      (YAML writes an empty one so); else it is an unknown key.
    - ``name_aliases``: a key given by an alias is reported as "alias of <path>", and
      one setting given under two names is refused naming the canonical one.
    - ``filled_by``: who fills ``"auto"`` at run time, for the notes.
    - ``carried_note``: the note on passthrough keys.
    - ``locate_unknown``: unknown-key errors name the section (the error's key always does).
    """

    def __init__(self, located: Located, table: MappingTable, report: Report, *, consumer: str,
                 bools: Literal["strict", "accelerate"] = "strict",
                 top_level_typos: Literal["error", "carry"] = "carry",
                 normalize: Callable[[str, str], str] | None = None, null_is_empty: bool = True,
                 name_aliases: bool = False, filled_by: str = "",
                 carried_note: str = "not a sharding setting: carried verbatim", locate_unknown: bool = True) -> None:
        self.located, self.table, self.report, self.consumer = located, table, report, consumer
        self.bools, self.top_level_typos, self.null_is_empty = bools, top_level_typos, null_is_empty
        self.name_aliases, self.filled_by = name_aliases, filled_by
        self.carried_note, self.locate_unknown = carried_note, locate_unknown
        self._normalize = normalize or (lambda prefix, key: key)
        self.values: dict[str, Any] = {}
        """Canonical path -> the value as given."""
        self.given_as: dict[str, str] = {}
        """Canonical path -> the key as the source spelled it."""
        self.carried: dict[str, Any] = {}
        """Dotted key -> value, carried verbatim for the way back."""
        self._walk("", located.data)

    def _walk(self, prefix: str, obj: dict[str, Any]) -> None:
        for raw, value in obj.items():
            spelled, path = _join(prefix, str(raw)), _join(prefix, self._normalize(prefix, str(raw)))
            row = self.table.find(path)
            if row is not None:
                if row.type not in ("section", "structural") and isinstance(value, dict):
                    raise self.located.error(f"expected a single value, got a section {value!r}", key=spelled)
                self._take(row, spelled, value)
                if row.type == "section" and isinstance(value, dict):
                    self._walk(path, value)
            elif path in self.table.removed:
                self.report.add(spelled, Status.NOT_EXPRESSIBLE,
                                f"removed from {self.consumer}, which now raises on it: "
                                f"{self.table.removed[path]}; not written")
            elif self.table.is_passthrough(path):
                self.carried[path] = value
                self.report.add(spelled, Status.NOT_ABOUT_SHARDING, self.carried_note)
            elif self.table.children(path) and (isinstance(value, dict) or value is None and self.null_is_empty):
                self._walk(path, value or {})
            elif self.table.children(path):
                raise self.located.error(f"expected a section (keys and values), got {value!r}", key=spelled,
                                         fix=f"write {spelled!r} as an object, or leave it out")
            else:
                self._unknown(prefix, spelled, str(raw), value)

    def spec_error(self, exc: ValidationError) -> ConfigError:
        """A spec validation error, pointed at the source key(s) that set the
        failing spec field, found through the table."""
        error = from_validation_error(exc, source=self.located.source)
        spec_path = error.key or ""
        feeding = [row for row in self.table.rows if row.path in self.values and row.spec and (
            row.spec == spec_path or spec_path.startswith(row.spec + ".") or row.spec.startswith(spec_path + "."))]
        exact = [row for row in feeding if row.spec == spec_path]
        chosen = exact if len(exact) == 1 else feeding
        if len(chosen) == 1:
            key = self.given_as[chosen[0].path]
            return ConfigError(f"{error.message} (spec field {spec_path})", source=self.located.source,
                               key=key, line=self.located.line_of(key), fix=error.fix)
        if chosen:
            keys = ", ".join(self.given_as[row.path] for row in chosen)
            return ConfigError(f"{error.message} (set by {keys})", source=self.located.source, key=spec_path,
                               line=self.located.line_of(self.given_as[chosen[0].path]), fix=error.fix)
        return error

    def _take(self, row: Row, spelled: str, value: Any) -> None:
        if row.path in self.values:
            aliases = " (aliases of one setting)" if self.name_aliases else ""
            raise self.located.error(f"given twice, as {self.given_as[row.path]!r} and {spelled!r}{aliases}",
                                     key=spelled, fix=f"keep only {row.path!r}" if aliases else "keep one of them")
        self.values[row.path], self.given_as[row.path] = value, spelled

    def _unknown(self, prefix: str, spelled: str, key: str, value: Any) -> None:
        known = self.table.children(prefix)
        match = closest(key, known)
        strict, ignoring = prefix in self.table.strict_sections, self.top_level_typos == "error"
        if strict or ignoring and not prefix and match is not None and _very_close(key, match):
            where = (f" in {prefix!r}" if prefix else " at the top level") if self.locate_unknown else ""
            why = "rejects unknown keys here" if strict else "would silently ignore it"
            reason = f": {self.consumer} {why}" if ignoring else ""
            listing = f"valid keys{where}: " if self.locate_unknown else "use one of: "
            raise self.located.error(f"unknown key {key!r}{where}{reason}", key=spelled,
                                     fix=f"did you mean {match!r}?" if match else listing + ", ".join(known))
        self.carried[spelled] = value
        how = f"; {self.consumer} ignores unknown top-level keys; carried" if ignoring else ": carried"
        self.report.add(spelled, Status.NOT_ABOUT_SHARDING, f"not a {self.consumer} setting zerobridge knows{how}")

    def given(self, path: str) -> bool:
        """Whether the source gives canonical ``path`` (under any of its names)."""
        return path in self.values

    def key(self, path: str) -> str:
        """``path`` as the source spelled it."""
        return self.given_as.get(path, path)

    def error(self, path: str, message: str, fix: str | None = None) -> ConfigError:
        """A ``ConfigError`` pointing at ``path`` as the source spelled it."""
        return self.located.error(message, key=self.key(path) or None, fix=fix)

    def get(self, path: str, *, minimum: float | None = None) -> Any:
        """The value at canonical ``path``, coerced by the row's type, or the row's default."""
        row = self.table.row(path)
        if path not in self.values:
            return row.default if row.has_default else None
        return self.coerce(row, self.values[path], self.key(path), minimum=minimum)

    def coerce(self, row: Row, value: Any, key: str, *, minimum: float | None = None) -> Any:
        """``value`` as ``row``'s type (``key`` names it in errors); other types pass through."""
        loc = self.located
        if row.auto and is_auto(value):
            return AUTO
        if row.type == "int":
            return as_int(loc, key, value, auto=row.auto, minimum=None if minimum is None else int(minimum))
        if row.type == "float":
            return as_float(loc, key, value, minimum=minimum)
        if row.type == "bool":
            return self._bool(key, value)
        if row.type == "dtype":
            return as_dtype(loc, key, value)
        if row.type in ("enum", "str") and row.values:
            text = "no" if value is False and "no" in row.values else str(value)
            for choice in row.values:
                if choice.lower() == text.lower():
                    return choice
            match = closest(text, row.values)
            raise loc.error(f"expected one of {', '.join(row.values)}, got {value!r}", key=key,
                            fix=f"did you mean {match!r}?" if match else None)
        return value

    def flag(self, path: str, default: Any = None) -> bool:
        """The boolean given or carried at ``path`` (else ``default``), read as the consumer reads one."""
        return self._bool(self.key(path), self.values.get(path, self.carried.get(path, default)))

    def _bool(self, key: str, value: Any) -> bool:
        if self.bools == "strict":
            return bool(as_bool(self.located, key, value))
        text = str(value).lower()
        if text in TRUTHY or text in FALSY:
            return text in TRUTHY
        raise self.located.error(f"expected true or false, got {value!r}", key=key, fix="write true or false")

    def note(self, path: str, status: Status | None = None, extra: str = "", *, target: str = "") -> None:
        """Report ``path`` (as spelled) with its table note and ``extra``, or its default when absent."""
        row = self.table.row(path)
        target = target or row.spec
        if path not in self.values:
            if row.has_default:
                self.report.add(path, status or Status.DEFAULT,
                                join_notes(f"absent: {self.consumer} default {row.default!r}", extra), target=target)
            return
        key = self.key(path)
        if row.auto and is_auto(self.values[path]):
            by = f" by {self.filled_by}" if self.filled_by else ""
            self.report.add(key, Status.AUTO, join_notes(f"kept as \"auto\": filled at run time{by}", extra),
                            target=target)
            return
        deprecated = f"deprecated, read as {row.deprecated}; " if row.deprecated else ""
        alias = f"alias of {path}; " if self.name_aliases and key != path else ""
        self.report.add(key, status or row.status, join_notes(deprecated + alias + row.note, extra), target=target)

    def mark(self, path: str, status: Status, note: str) -> None:
        """Report ``path`` with ``note`` in place of the table's, targeting the row's spec field."""
        self.report.add(self.key(path), status, note, target=self.table.row(path).spec)

    def note_rest(self) -> None:
        """Report every given key not reported yet; a switch that is off changes nothing."""
        for path in self.values:
            if self.report.find(self.key(path)) is None:
                off = self.table.row(path).type == "bool" and self.values[path] in (False, "false", "False")
                self.note(path, Status.EXACT if off else None, "off" if off else "")

    def carry(self, path: str, value: Any, default: Any = None) -> None:
        """Carry ``value`` at dotted ``path`` for the way back, unless it is ``default``."""
        if value != default:
            self.carried[path] = value

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


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _very_close(word: str, match: str) -> bool:
    return difflib.SequenceMatcher(None, word, match).ratio() >= 0.85


def join_notes(*parts: str) -> str:
    """The non-empty ``parts`` as one report note."""
    return "; ".join(p for p in parts if p)


_UNION_TAGS = frozenset(
    [m.model_fields["kind"].default for m in (NoLossScale, StaticLossScale, DynamicLossScale)]
    + [m.model_fields["policy"].default for m in (RootWrap, EveryModuleWrap, TransformerWrap, SizeWrap)])
"""Tag values of the spec's discriminated unions (they appear in error locations)."""


def from_validation_error(
    error: ValidationError, *, source: str | Path | None = None, key_prefix: str = ""
) -> ConfigError:
    """The first problem of a pydantic error as a ``ConfigError``."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if not str(part).startswith(("function-", "tagged-union"))]
    # Union branches add their type names or tag values to the location; keep
    # real keys only.
    loc = [part for part in loc if not part.startswith(("int", "str", "literal", "constrained"))
           and part not in _UNION_TAGS]
    key = ".".join(part for part in [key_prefix, *loc] if part) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden" and loc:
        message = f"unknown key {loc[-1]!r}"
    extra = len(error.errors()) - 1
    if extra > 0 and first["type"] != "extra_forbidden":
        message += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return ConfigError(message, source=source, key=key)


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
