"""The report every translation returns: what each source key became.

    >>> from zerobridge.translate.report import Report, Status
    >>> r = Report(source="deepspeed", target="fsdp2")
    >>> r.add("sharding", Status.APPROXIMATED, "ZeRO-2 keeps parameters full", target="reshard_after_forward")
    >>> r.approximations[0].key
    'sharding'
    >>> r.add("communication.reduce_bucket", Status.NOT_EXPRESSIBLE, "FSDP communicates once per unit")
    >>> r.add("compile", Status.NOT_EXPRESSIBLE, "FSDP2 takes no compile setting")
    >>> [(e.key, e.impact.value) for e in r.warnings], [e.key for e in r.speed_only]
    ([('sharding', 'memory'), ('communication.reduce_bucket', 'memory')], ['compile'])

Every entry says what it changes (``Impact``): the numbers the run computes,
its memory, or only its speed. Warnings on stderr are for the first two; the
speed-only entries fold into one line (``speed_only``) and ``--explain``
lists them. The impact follows the spec path an entry is about (its key when
writing, its target when reading), by the longest prefix in ``IMPACTS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

__all__ = ["IMPACTS", "Entry", "Impact", "Report", "Status", "Translation", "impact_of"]

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
    OVERRIDDEN = "overridden"
    """Replaced by a value given on the command line (``convert --world-size``),
    as a launcher's flag overrides its config. Warned on stderr; the run
    changes as asked, so it is not an approximation."""


class Impact(StrEnum):
    """What an entry changes in the run, when it is not carried exactly."""

    NUMBERS = "numbers"
    """What the run computes: losses, gradients, the learning rate, what a
    checkpoint holds."""
    MEMORY = "memory"
    """The same numbers in different memory: what is sharded, offloaded or
    gathered at once."""
    SPEED = "speed"
    """The same numbers and memory at rest; only speed (prefetch timing,
    overlap, compile) or logging. Bucket sizes are memory: DeepSpeed
    preallocates its buckets."""


IMPACTS: dict[str, Impact] = {
    "sharding": Impact.MEMORY, "sharding.world_size": Impact.NUMBERS,
    "offload": Impact.MEMORY, "wrapping": Impact.MEMORY,
    "communication": Impact.SPEED, "communication.wire": Impact.NUMBERS, "compile": Impact.SPEED,
    "communication.reduce_bucket": Impact.MEMORY, "communication.allgather_bucket": Impact.MEMORY,
    "communication.prefetch_bucket": Impact.MEMORY, "communication.max_live_parameters": Impact.MEMORY,
    "communication.persistence_threshold": Impact.MEMORY, "communication.model_persistence_threshold": Impact.MEMORY,
    "precision": Impact.NUMBERS, "precision.compute_copy": Impact.MEMORY,
    "batch": Impact.NUMBERS, "batch.grad_sync": Impact.MEMORY,
    "checkpoint": Impact.NUMBERS, "checkpoint.activation_checkpointing": Impact.MEMORY,
    "optimizer": Impact.NUMBERS, "scheduler": Impact.NUMBERS,
    "passthrough.deepspeed.optimizer": Impact.NUMBERS, "passthrough.deepspeed.scheduler": Impact.NUMBERS,
    "passthrough": Impact.SPEED,
}
"""Spec path prefix -> what a difference there changes (the longest prefix wins).
DeepSpeed's ``optimizer`` and ``scheduler`` sections keep their own names. Buckets,
prefetch and the live-parameter bounds are memory: DeepSpeed preallocates its
reduce buckets and holds what it gathers ahead (``translate/deepspeed_buckets.py``)."""


def impact_of(*paths: str) -> Impact:
    """The impact of the first of ``paths`` that ``IMPACTS`` knows; numbers when none
    is known (an unknown difference is assumed to matter)."""
    for path in paths:
        parts = path.split(".")
        for n in range(len(parts), 0, -1):
            found = IMPACTS.get(".".join(parts[:n]))
            if found is not None:
                return found
    return Impact.NUMBERS


WARN = (Status.APPROXIMATED, Status.NOT_EXPRESSIBLE, Status.IGNORED)
"""Statuses that change the run (``--strict`` exits 1 on them)."""

NOTICE = (*WARN, Status.SYNTAX, Status.OVERRIDDEN)
"""Statuses said on stderr (speed-only ones folded into one line)."""


@dataclass(frozen=True)
class Entry:
    """One line of a report."""

    key: str
    """Key path in the source (or spec path when writing a target)."""
    status: Status
    note: str = ""
    target: str = ""
    """Where it went in the target, if anywhere."""
    impact: Impact = Impact.NUMBERS
    """What it changes when not carried exactly (``impact_of`` its key or target)."""


@dataclass
class Report:
    """Key-by-key account of one translation."""

    source: str
    target: str
    entries: list[Entry] = field(default_factory=list)

    def add(self, key: str, status: Status, note: str = "", *, target: str = "",
            impact: Impact | None = None) -> None:
        """Record what happened to ``key``; a later entry for the same key and
        target replaces the earlier one. ``impact`` defaults to ``impact_of(key, target)``."""
        entry = Entry(key, status, note, target, impact or impact_of(key, target))
        for i, old in enumerate(self.entries):
            if old.key == key and old.target == target:
                self.entries[i] = entry
                return
        self.entries.append(entry)

    def extend(self, other: Report) -> None:
        """Append another report's entries (a two-step translation)."""
        for entry in other.entries:
            self.add(entry.key, entry.status, entry.note, target=entry.target, impact=entry.impact)

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
        """Entries to warn about on stderr, one line each: those that change the numbers or the
        memory, syntax other readers refuse, and command-line overrides. A warned section
        covers the keys under it."""
        said: list[Entry] = []
        for e in self.with_status(*NOTICE):
            if e.impact is Impact.SPEED and e.status in WARN:
                continue
            if not any(e.key.startswith(head.key + ".") for head in said):
                said.append(e)
        return said

    @property
    def speed_only(self) -> list[Entry]:
        """Approximated or dropped entries that change only speed: said on stderr as one line."""
        return [e for e in self.with_status(*WARN) if e.impact is Impact.SPEED]

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
            changes = f" ({e.impact.value})" if e.status in WARN else ""
            lines.append(f"  {e.key:<{width}}  {e.status.value:<18}{arrow}{note}{changes}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-compatible form."""
        return {
            "source": self.source,
            "target": self.target,
            "exact": self.exact,
            "entries": [dataclasses.asdict(e) | {"status": e.status.value, "impact": e.impact.value}
                        for e in self.entries],
        }


@dataclass(frozen=True)
class Translation(Generic[T]):
    """A translated value and its report."""

    value: T
    report: Report
