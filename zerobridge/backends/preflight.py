"""Whether a backend can run a spec, decided before any process starts.

    >>> from zerobridge.spec.presets import spec_for_stage
    >>> from zerobridge.backends.preflight import preflight
    >>> preflight("fsdp", spec_for_stage(3), world_size=2)
    []
    >>> try:
    ...     preflight("fsdp", spec_for_stage(1), world_size=2)
    ... except Exception as exc:
    ...     print(exc.key)
    sharding
    >>> [e.key for e in preflight("fsdp", spec_for_stage(1), world_size=2, allow_approximate=True)]
    ['sharding']

``zerobridge run --backend`` and ``zerobridge compare`` ask here, so a spec
a backend refuses is reported (or listed as skipped) with the same message
``zerobridge.prepare`` would raise inside the workers.
"""

from __future__ import annotations

from zerobridge.backends.deepspeed.config import launch_problems, refusal
from zerobridge.backends.fsdp.assess import CLOSEST_STAGE, assess, refuse
from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.translate.report import Entry

__all__ = ["formula_stage", "preflight"]


def preflight(backend: str, spec: StrategySpec, *, world_size: int | None, local_world_size: int | None = None,
              allow_approximate: bool = False) -> list[Entry]:
    """The approximations ``backend`` would run ``spec`` with at ``world_size`` ranks.

    Raises ``ConfigError`` (naming the spec key and the fix) when the backend
    refuses the spec outright, or when it would approximate and
    ``allow_approximate`` is false. ``world_size=None``: the checks that need
    it are skipped (the launcher cannot always tell).
    """
    if backend == "native":
        _native(spec, world_size, local_world_size)
        return []
    if backend == "fsdp":
        return _fsdp(spec, world_size, local_world_size, allow_approximate)
    if backend == "deepspeed":
        return _deepspeed(spec, world_size, allow_approximate)
    raise ConfigError(f"unknown backend {backend!r}", key="backend", fix="choose native, fsdp or deepspeed")


def formula_stage(backend: str, spec: StrategySpec, approximations: list[Entry]) -> int | None:
    """The ZeRO stage whose memory and traffic formulas describe the closest form
    ``backend`` runs for ``spec`` with ``approximations`` (``preflight``'s answer), when
    that is FSDP2's form of ZeRO-1 or ZeRO-2 sharding; None otherwise (the spec's own)."""
    if backend == "fsdp" and any(e.key == "sharding" for e in approximations):

        return CLOSEST_STAGE.get(spec.sharding.stage.value)
    return None


def _native(spec: StrategySpec, world_size: int | None, local_world_size: int | None) -> None:
    from zerobridge.engine.plan import check_runnable  # lazy: loads torch, only for the native engine

    check_runnable(spec, world_size=world_size, local_world_size=local_world_size)


def _fsdp(spec: StrategySpec, world_size: int | None, local_world_size: int | None,
          allow_approximate: bool) -> list[Entry]:
    if world_size is None:
        return []

    found = assess(spec, world_size=world_size, local_world_size=local_world_size or world_size).approximations
    if not allow_approximate:
        refuse(found)
    return found


def _deepspeed(spec: StrategySpec, world_size: int | None, allow_approximate: bool) -> list[Entry]:
    error, found = launch_problems(spec, world_size=world_size)
    if error is not None:
        raise error
    if found and not allow_approximate:
        raise refusal(found)
    return found
