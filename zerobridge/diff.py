"""Whether two specs mean the same run, and exactly what differs.

    >>> from zerobridge.load import load_spec
    >>> from zerobridge.diff import diff_specs
    >>> result = diff_specs(load_spec("zero2").value, load_spec("zero3").value)
    >>> result.same_run, result.differences[0].path
    (False, 'sharding.parameters')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerobridge.spec import StrategySpec

__all__ = ["Difference", "SpecDiff", "diff_specs"]


@dataclass(frozen=True)
class Difference:
    """One field that differs."""

    path: str
    a: Any
    b: Any


@dataclass(frozen=True)
class SpecDiff:
    """All differences between two specs."""

    differences: tuple[Difference, ...]
    """Spec fields that differ: a different run."""
    carried: tuple[Difference, ...]
    """Carried settings of a format both sources share (optimizer, scheduler,
    ...) that differ: also a different run, outside sharding."""

    @property
    def same_run(self) -> bool:
        """Whether nothing that changes the run differs."""
        return not self.differences and not self.carried

    def render(self, name_a: str, name_b: str) -> str:
        """Plain text: a verdict line, then one line per difference."""
        if self.same_run:
            return f"same run: {name_a} and {name_b} mean the same strategy"
        lines = [f"different runs: {len(self.differences) + len(self.carried)} difference(s)",
                 f"  a = {name_a}", f"  b = {name_b}"]
        width = max(len(d.path) for d in (*self.differences, *self.carried))
        for d in self.differences:
            lines.append(f"  {d.path:<{width}}  a: {_show(d.a)}  b: {_show(d.b)}")
        for d in self.carried:
            lines.append(f"  {d.path:<{width}}  a: {_show(d.a)}  b: {_show(d.b)}  (not about sharding)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-compatible form."""
        return {"same_run": self.same_run,
                "differences": [d.__dict__ for d in self.differences],
                "carried": [d.__dict__ for d in self.carried]}


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


_ABSENT = object()


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def _compare(a: dict[str, Any], b: dict[str, Any], prefix: str) -> tuple[Difference, ...]:
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    _flatten(a, prefix, flat_a)
    _flatten(b, prefix, flat_b)
    keys = list(dict.fromkeys([*flat_a, *flat_b]))
    return tuple(Difference(k, flat_a.get(k, _ABSENT), flat_b.get(k, _ABSENT))
                 for k in keys if flat_a.get(k, _ABSENT) != flat_b.get(k, _ABSENT))


def diff_specs(a: StrategySpec, b: StrategySpec) -> SpecDiff:
    """Compare every spec field; carried settings only for formats both have."""
    dump_a = a.model_dump(mode="json", exclude={"name", "passthrough"})
    dump_b = b.model_dump(mode="json", exclude={"name", "passthrough"})
    shared = sorted(set(a.passthrough) & set(b.passthrough))
    carried: tuple[Difference, ...] = ()
    for fmt in shared:
        carried += _compare(a.passthrough[fmt], b.passthrough[fmt], f"passthrough.{fmt}")
    return SpecDiff(_compare(dump_a, dump_b, ""), carried)
