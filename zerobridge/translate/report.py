"""The report every translation returns: what each source key became.

    >>> from zerobridge.translate.report import Report, Status
    >>> r = Report(source="deepspeed", target="fsdp2")
    >>> r.add("zero_optimization.stage", Status.APPROXIMATED, "ZeRO-2 keeps parameters full",
    ...       target="reshard_after_forward")
    >>> r.approximations[0].key
    'zero_optimization.stage'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

__all__ = ["Entry", "Report", "Status", "Translation"]

T = TypeVar("T")


class Status(StrEnum):
    """How faithfully a key was carried over."""

    EXACT = "exact"
    """Same meaning, same mechanics."""
    EQUIVALENT = "equivalent"
    """Same math, different mechanics (the note says how)."""
    APPROXIMATED = "approximated"
    """The closest form; the note says what differs. Warned on stderr."""
    NOT_EXPRESSIBLE = "not_expressible"
    """The target has no form for it; dropped, with the reason."""
    NOT_ABOUT_SHARDING = "not_about_sharding"
    """Not a sharding setting: carried through verbatim, or listed."""
    AUTO = "auto"
    """Kept as ``"auto"``: the launcher or trainer fills it at run time."""
    DEFAULT = "default"
    """Absent from the source: its effective default was written explicitly."""
    IGNORED = "ignored"
    """The source's own consumer ignores it (e.g. offload_param below stage
    3). Warned on stderr."""
    SYNTAX = "syntax"
    """Read as the source's consumer reads it, but other readers of the same
    file refuse it (JSON only hjson accepts). Warned on stderr; it changes
    nothing in the run, so it is not an approximation."""


WARN = (Status.APPROXIMATED, Status.NOT_EXPRESSIBLE, Status.IGNORED)
"""Statuses that change the run (``--strict`` exits 1 on them)."""


@dataclass(frozen=True)
class Entry:
    """One line of a report."""

    key: str
    """Key path in the source (or spec path when writing a target)."""
    status: Status
    note: str = ""
    target: str = ""
    """Where it went in the target, if anywhere."""


@dataclass
class Report:
    """Key-by-key account of one translation."""

    source: str
    target: str
    entries: list[Entry] = field(default_factory=list)

    def add(self, key: str, status: Status, note: str = "", *, target: str = "") -> None:
        """Record what happened to ``key``; a later entry for the same key and
        target replaces the earlier one."""
        entry = Entry(key, status, note, target)
        for i, old in enumerate(self.entries):
            if old.key == key and old.target == target:
                self.entries[i] = entry
                return
        self.entries.append(entry)

    def extend(self, other: Report) -> None:
        """Append another report's entries (a two-step translation)."""
        for entry in other.entries:
            self.add(entry.key, entry.status, entry.note, target=entry.target)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def find(self, key: str) -> Entry | None:
        """The entry for ``key``, if any."""
        return next((e for e in self.entries if e.key == key), None)

    def with_status(self, *statuses: Status) -> list[Entry]:
        """Entries with any of ``statuses``."""
        return [e for e in self.entries if e.status in statuses]

    @property
    def approximations(self) -> list[Entry]:
        """Entries that change the run: approximated, not expressible or ignored."""
        return self.with_status(*WARN)

    @property
    def warnings(self) -> list[Entry]:
        """Entries to warn about on stderr: the approximations, and syntax other readers refuse."""
        return self.with_status(*WARN, Status.SYNTAX)

    @property
    def exact(self) -> bool:
        """Whether nothing was approximated or dropped."""
        return not self.approximations

    def render(self) -> str:
        """A plain-text table, one key per line."""
        if not self.entries:
            return f"{self.source} -> {self.target}: nothing to report"
        width = max(len(e.key) for e in self.entries)
        lines = [f"{self.source} -> {self.target}"]
        for e in self.entries:
            arrow = f" -> {e.target}" if e.target else ""
            note = f"  {e.note}" if e.note else ""
            lines.append(f"  {e.key:<{width}}  {e.status.value:<18}{arrow}{note}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-compatible form."""
        return {
            "source": self.source,
            "target": self.target,
            "exact": self.exact,
            "entries": [dataclasses.asdict(e) | {"status": e.status.value} for e in self.entries],
        }


@dataclass(frozen=True)
class Translation(Generic[T]):
    """A translated value and its report."""

    value: T
    report: Report
