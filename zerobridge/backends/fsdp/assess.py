"""What torch FSDP2 runs for a spec, and what it refuses: the translator's report, judged.

    >>> from zerobridge.spec.presets import spec_for_stage
    >>> from zerobridge.backends.fsdp.assess import assess
    >>> [e.key for e in assess(spec_for_stage(3), world_size=2, local_world_size=2).approximations]
    []
    >>> [e.key for e in assess(spec_for_stage(1), world_size=2, local_world_size=2).approximations]
    ['sharding']

``write_fsdp2`` (``zerobridge/translate/fsdp2.py``) writes the spec as
``fully_shard`` arguments and reports every key it could not state exactly.
The backend does more than a bare ``fully_shard`` call (it cuts the native
engine's units, resolves ``auto`` as the native engine does, casts buffers,
runs the native loss scaler, clipping and accumulation rule), so part of that
report does not apply to it. ``assess`` sorts every entry:

- *handled*: the backend does exactly what the native engine does (``HANDLED``);
- *tuning*: a scheduling knob FSDP2 fixes (bucket sizes, prefetch depth,
  overlap): same numbers, other collectives; recorded, never refused;
- *approximation*: anything else; refused unless ``allow_approximate=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.translate.carried import SECTIONS
from zerobridge.translate.fsdp2 import write_fsdp2
from zerobridge.translate.keys import from_validation_error
from zerobridge.translate.report import Entry, Status

__all__ = ["CLOSEST_STAGE", "HANDLED", "Assessment", "assess", "refuse", "resolved", "with_world"]

HANDLED: dict[str, str] = {
    "wrapping": "units cut by zerobridge.runtime.wrap_units.unit_modules, the native engine's own",
    "precision.buffer_dtype": "buffers cast to buffer_dtype before fully_shard, as the native engine does",
    "precision.loss_scaling": "the native engine's loss scaler (hysteresis, minimum scale) runs around FSDP2",
    "precision.skip_nonfinite_steps": "non-finite steps skipped by the native engine's rule",
    "precision.param_dtype": "\"auto\" resolved as the native engine does",
    "precision.reduce_dtype": "\"auto\" resolved as the native engine does",
    "batch.clip_grad_norm": "clipping resolved and applied at step time as the native engine does",
    "batch.accumulation_steps": "accumulation steps resolved as the native engine does",
    "batch.micro_batch_size": "left to the data loader, as on the native engine",
    "batch.global_batch_size": "left to the data loader, as on the native engine",
    "checkpoint.format": "checkpoints are zerobridge's format (docs/checkpoints.md) on every backend",
}
"""Report keys whose FSDP2 caveat does not apply here, and why."""

_TUNING_PREFIXES = ("communication.", "offload.sub_group_size")
_CLOSEST: dict[str, str] = {
    "sharding": "reshard_after_forward=False over the shard group (parameters, gradients and optimizer state "
                "sharded between steps; parameters gathered once per step)",
    "offload.parameters.device": "the offload the note names (CPUOffloadPolicy moves parameters, gradients and "
                                 "the optimizer step together)",
    "offload.optimizer.device": "the offload the note names (host memory in place of NVMe; no offload of an "
                                "optimizer tier offloaded alone)",
    "offload.optimizer.ratio": "the whole optimizer step on the host",
    "precision.accumulate_dtype": "gradient accumulation in the master dtype",
    "wrapping": "the enclosing unit with the inner one merged into it",
    "communication.wire": "full-precision collectives",
}
"""The closest FSDP2 form of each refused key, named in the refusal's fix."""

CLOSEST_STAGE: dict[int, int] = {1: 2, 2: 2}
"""ZeRO stages FSDP2 has no form for, and the stage whose formulas its closest form
(``_CLOSEST["sharding"]``) is measured against: gradients and optimizer state are
sharded as in ZeRO-2, parameters are sharded at rest as well, so it holds less."""


@dataclass(frozen=True)
class Assessment:
    """The FSDP2 form of a spec and the sorted report."""

    form: dict[str, Any]
    """``write_fsdp2``'s JSON form of the resolved spec (mesh, reshard, mp_policy, offload, ...)."""
    approximations: list[Entry] = field(default_factory=list)
    """What FSDP2 runs differently (refused unless ``allow_approximate``)."""
    tuning: list[Entry] = field(default_factory=list)
    """Scheduling knobs FSDP2 fixes: same numbers, other collectives."""
    equivalent: list[Entry] = field(default_factory=list)
    """Entries the translator flags that are exact or equivalent here, with the reason."""


def with_world(spec: StrategySpec, world_size: int) -> StrategySpec:
    """``spec`` stating ``world_size`` ranks (validated again: group sizes must divide it);
    ``ConfigError`` when it states another."""
    spec.sharding.check_world(world_size)
    if spec.sharding.world_size == world_size:
        return spec
    data = spec.model_dump()
    data["sharding"]["world_size"] = world_size
    try:
        return StrategySpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def resolved(spec: StrategySpec, *, world_size: int, local_world_size: int) -> StrategySpec:
    """``spec`` with the world size and ``"node"`` groups filled in (FSDP2 needs numbers)."""
    spec = with_world(spec, world_size)
    s = spec.sharding
    update: dict[str, Any] = {}
    if s.shard_group == "node":
        update["shard_group"] = local_world_size
    if s.backward_gather_group == "node":
        update["backward_gather_group"] = local_world_size
    group = update.get("shard_group", s.shard_group)
    if isinstance(group, int) and group == world_size:
        update["shard_group"] = "world"
    if not update:
        return spec
    return spec.model_copy(update={"sharding": s.model_copy(update=update)})


def _stage0(entry: Entry, form: dict[str, Any]) -> bool:
    mesh = form.get("mesh")
    return entry.key == "sharding" and mesh is not None and mesh["shape"][-1] == 1


def assess(spec: StrategySpec, *, world_size: int, local_world_size: int,
           accumulation_steps: int | None = None) -> Assessment:
    """Translate ``spec`` for FSDP2 at this world size and sort the report (``ConfigError``
    when the spec cannot run at this world size at all). ``accumulation_steps``: as resolved
    for the run (default: the spec's)."""
    translation = write_fsdp2(resolved(spec, world_size=world_size, local_world_size=local_world_size))
    form, out = translation.value, Assessment(translation.value)
    accumulation = accumulation_steps if accumulation_steps is not None else spec.batch.accumulation_steps
    for entry in translation.report.approximations:
        if entry.key in HANDLED or entry.key.split(".")[0] in SECTIONS:
            continue  # SECTIONS: the script's optimizer and scheduler, not FSDP's to run
        if entry.key.startswith(_TUNING_PREFIXES) and not entry.key.startswith("communication.wire"):
            out.tuning.append(entry)  # a quantized payload changes the numbers: never mere tuning
        elif entry.key == "precision.accumulate_dtype" and accumulation == 1:
            out.equivalent.append(Entry(entry.key, Status.EQUIVALENT, "one micro-batch per step: nothing "
                                        "accumulates across micro-batches", entry.target))
        elif _stage0(entry, form):
            out.equivalent.append(Entry(entry.key, Status.EQUIVALENT, "the 2-D mesh [world, 1] keeps full "
                                        "parameters, gradients and optimizer state on every rank and all-reduces "
                                        "gradients across the replicas: stage 0's memory and math", entry.target))
        elif entry.key == "sharding.shard_group" and entry.status is Status.IGNORED:
            continue  # nothing is sharded at stage 0
        else:
            out.approximations.append(entry)
    return out


def refuse(approximations: list[Entry]) -> None:
    """Raise ``ConfigError`` naming every spec key FSDP2 cannot run exactly, and the fix."""
    if not approximations:
        return
    first, *others = approximations
    also = "".join(f"; also {e.key}: {e.note}" for e in others)
    closest = _CLOSEST.get(first.key) or _CLOSEST.get(first.key.split(".")[0], "the closest FSDP2 form named above")
    raise ConfigError(f"torch FSDP2 cannot run this exactly: {first.note}{also}", key=first.key,
                      fix=f"use backend='native', change the spec, or pass allow_approximate=True to run {closest} "
                          "instead (recorded in zerobridge.stats(model)['approximations'])")
