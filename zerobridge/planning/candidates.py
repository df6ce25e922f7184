"""The layouts a plan weighs: ZeRO stages, hybrid and hpZ layouts across nodes, offload tiers,
activation checkpointing on and off, and the user's own strategies.

    >>> from zerobridge.planning.candidates import candidates
    >>> from zerobridge.planning.models import resolve_model
    >>> model = resolve_model("tiny-gpt").build()
    >>> [c.name for c in candidates(model, nodes=1, ranks_per_node=8)][:5]
    ['zero0', 'zero1', 'zero2', 'zero3', 'zero2-offload']
    >>> [c.name for c in candidates(model, nodes=2, ranks_per_node=8) if "hybrid" in c.name or "hpz" in c.name]
    ['zero2-hybrid', 'zero3-hybrid', 'zero3-hpz', 'zero2-hybrid+ac', 'zero3-hybrid+ac', 'zero3-hpz+ac']

Each is a stage preset (``spec_for_stage``: one unit per transformer layer at
stage 3, prefetch one unit ahead) with one thing changed:

    zero0..zero3              the ZeRO stages over the whole world
    zero2-hybrid, zero3-hybrid  sharded inside a node, replicated across nodes
                                (FSDP's HYBRID_SHARD / _HYBRID_SHARD_ZERO2; nodes > 1)
    zero3-hpz                 stage 3 with a secondary parameter shard per node (ZeRO++ hpZ; nodes > 1)
    zero2-offload             the optimizer (master and moments) and its step on the host
    zero3-offload-optimizer   the same at stage 3
    zero3-offload             parameters and optimizer on the host (ZeRO-Offload at stage 3)
    NAME+ac                   activation checkpointing of every unit (the wrap is one unit per
                              transformer layer at every stage, so recomputation is per layer)

Written for DeepSpeed (``plan --to deepspeed``), a candidate's buckets are sized
to the model's largest wrap unit (``deepspeed_form``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from zerobridge.runtime.wrap_units import bucket_sizes
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.spec.wrapping import EveryModuleWrap, TransformerWrap
from zerobridge.translate.deepspeed_buckets import BucketSizes

__all__ = ["Candidate", "candidates", "deepspeed_form", "with_checkpointing"]


@dataclass(frozen=True)
class Candidate:
    """One layout to measure."""

    name: str
    spec: StrategySpec
    own: bool = False
    """The user's own strategy (``--config`` / ``--strategy``), not one the planner made."""


def _changed(spec: StrategySpec, **sections: dict[str, Any]) -> StrategySpec:
    data = spec.model_dump()
    for section, values in sections.items():
        data[section] = {**data[section], **values}
    return StrategySpec.model_validate(data)


def with_checkpointing(spec: StrategySpec, model: nn.Module) -> StrategySpec:
    """``spec`` with every unit's activations recomputed in backward; a spec that wraps the model
    as one unit is cut per transformer layer first (recomputing the whole model saves nothing)."""
    data = spec.model_dump()
    data["checkpoint"] = {**data["checkpoint"], "activation_checkpointing": True}
    if data["wrapping"]["policy"] == "root":
        wrap = TransformerWrap() if getattr(model, "_no_split_modules", None) else EveryModuleWrap()
        data["wrapping"] = wrap.model_dump()
    return StrategySpec.model_validate(data)


def candidates(model: nn.Module, *, nodes: int, ranks_per_node: int, own: tuple[Candidate, ...] = ()
               ) -> list[Candidate]:
    """Every layout the planner weighs for ``model`` on ``nodes`` nodes of ``ranks_per_node``, then
    ``own``; each with and without activation checkpointing (the user's as given, plus ``+ac`` when
    it has none). Node groups are written as rank counts, so every format can state them."""
    stage = {s: spec_for_stage(s, model) for s in range(4)}
    plain = [Candidate(f"zero{s}", stage[s]) for s in range(4)]
    if nodes > 1:
        plain += [Candidate("zero2-hybrid", _changed(stage[2], sharding={"shard_group": ranks_per_node})),
                  Candidate("zero3-hybrid", _changed(stage[3], sharding={"shard_group": ranks_per_node})),
                  Candidate("zero3-hpz", _changed(stage[3], sharding={"backward_gather_group": ranks_per_node}))]
    host = {"device": "cpu"}
    plain += [Candidate("zero2-offload", _changed(stage[2], offload={"optimizer": host})),
              Candidate("zero3-offload-optimizer", _changed(stage[3], offload={"optimizer": host})),
              Candidate("zero3-offload", _changed(stage[3], offload={"optimizer": host, "parameters": host}))]
    out = plain + [Candidate(f"{c.name}+ac", with_checkpointing(c.spec, model)) for c in plain]
    for c in own:
        out.append(c)
        if not c.spec.checkpoint.activation_checkpointing:
            out.append(Candidate(f"{c.name}+ac", with_checkpointing(c.spec, model), own=True))
    return out


def deepspeed_form(spec: StrategySpec, model: nn.Module, *, own: bool) -> tuple[StrategySpec, BucketSizes | None]:
    """``spec`` as ``plan --to deepspeed`` writes it for ``model``, and the bucket sizes to write.

    A planner-made candidate's bucket sizes are the spec's defaults (DeepSpeed's own 5e8 and 5e7
    elements, which DeepSpeed preallocates: gigabytes on a small model), not a choice: they are left
    to the engine and sized to the model's largest wrap unit, as FSDP runs them. The user's own
    config (``own``) keeps the numbers it states."""
    if not own:
        comm = spec.communication.model_copy(update={"reduce_bucket": "per_unit", "allgather_bucket": "per_unit",
                                                     "prefetch_bucket": "per_unit"})
        spec = spec.model_copy(update={"communication": comm})
    return spec, bucket_sizes(model, spec)
