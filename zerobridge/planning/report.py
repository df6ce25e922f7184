"""A plan as people read it (a table and the recommendation) and as scripts read it (JSON).

    >>> from zerobridge.planning import plan
    >>> from zerobridge.planning.report import render, to_json
    >>> result = plan("tiny-gpt", world_size=2, device_memory="64MiB", micro_batch=2, seq_len=16, workers=1)
    >>> print(render(result).splitlines()[0])
    Plan for tiny-gpt (118,400 parameters) on 2 ranks = 1 node(s) x 2, micro-batch 2 x 16 tokens, bf16, adamw
    >>> to_json(result)["recommended"]
    'zero2'
"""

from __future__ import annotations

from typing import Any

from zerobridge.explain import format_bytes
from zerobridge.planning.planner import Plan, Row, ranks_needed

_FLAVOR_NAMES = {"native": "native engine", "fsdp2": "FSDP2 backend (fully_shard)",
                 "deepspeed": "DeepSpeed (its buffers modelled on the native run)"}

__all__ = ["no_fit_message", "render", "to_json"]


def _fit(row: Row) -> str:
    if row.fits:
        return "yes"
    return f"no, {format_bytes(-row.margin)} over" if row.margin < 0 else "no (host)"


def render(result: Plan) -> str:
    """The table of candidates, best first within each group, and the recommendation."""
    run = result.run
    lines = [
        f"Plan for {result.model} ({result.params:,} parameters) on {run.world_size} ranks = {run.nodes} node(s) x "
        f"{run.ranks_per_node}, micro-batch {run.micro_batch} x {run.seq_len} tokens, {result.precision}, "
        f"{run.optimizer}",
        f"device memory {format_bytes(result.device_memory)} per rank"
        + (f", host memory {format_bytes(result.host_memory)} per node" if result.host_memory else "")
        + f"; {result.how}, per rank, fake tensors; peaks for the {_FLAVOR_NAMES[result.flavor]}",
        "",
        f"{'candidate':<30}{'device peak':>12}{'host':>11}{'comm/step':>11}{'model states':>14}  "
        f"{'formula':<16}fits",
    ]
    for row in sorted(result.rows, key=lambda r: (not r.fits, r.comm_bytes, r.host_bytes, r.device_peak)):
        mark = "*" if row.own else "~" if row.approximation else " "
        lines.append(f"{mark}{row.name:<29}{format_bytes(row.device_peak):>12}{format_bytes(row.host_bytes):>11}"
                     f"{format_bytes(row.comm_bytes):>11}{format_bytes(row.model_state_bytes):>14}  "
                     f"{row.explanation.formula:<16}{_fit(row)}")
    best = result.recommended
    lines.append("")
    if best.fits:
        lines.append(f"recommended for {result.flavor}: {best.name}: {format_bytes(best.device_peak)} of "
                     f"{format_bytes(result.device_memory)} per rank ({format_bytes(best.margin)} to spare), "
                     f"{format_bytes(best.comm_bytes)} moved per step; the least communication of those that fit, "
                     "then the least offload, then no recomputation")
    else:
        lines.append(no_fit_message(result))
    if any(r.own for r in result.rows):
        lines.append("* your own strategy")
    approximated = {note: [r.name for r in result.rows if note in r.approximation]
                    for row in result.rows for note in row.approximation}
    for note, names in approximated.items():
        lines.append(f"~ {', '.join(names)}: {result.flavor} has no exact form; measured as it runs them: {note}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def no_fit_message(result: Plan) -> str:
    """Why nothing fits, and what would: more ranks, offload, a smaller micro-batch."""
    best = result.recommended
    run = result.run
    what = []
    more = ranks_needed(best, result.device_memory, run)
    if more is not None:
        what.append(f"{best.name} on {more} ranks ({more // run.ranks_per_node} nodes of {run.ranks_per_node})")
    if not best.offloaded:
        offloaded = [r for r in result.rows if r.offloaded]
        if offloaded:
            nearest = max(offloaded, key=lambda r: r.margin)
            what.append(f"offload ({nearest.name} needs {format_bytes(nearest.device_peak)})")
    if run.micro_batch > 1:
        what.append(f"a smaller --micro-batch (activations grow with it; {run.micro_batch} now)")
    if not best.recomputes:
        what.append("activation checkpointing")
    fix = "; ".join(what) if what else "more memory per rank"
    return (f"nothing fits in {format_bytes(result.device_memory)} per rank: the closest is {best.name} at "
            f"{format_bytes(best.device_peak)} ({format_bytes(-best.margin)} over). What would: {fix}")


def _row_json(row: Row) -> dict[str, Any]:
    return {"name": row.name, "own": row.own, "fits": row.fits, "device_peak_bytes": row.device_peak,
            "margin_bytes": row.margin, "host_bytes": row.host_bytes, "comm_bytes_per_step": row.comm_bytes,
            "comm_bytes_by_collective": row.comm_by_kind, "model_state_bytes": row.model_state_bytes,
            "model_state_formula": row.explanation.formula, "peak_bytes_by_phase": row.peaks,
            "activation_checkpointing": row.recomputes, "offloaded": row.offloaded, "flavor": row.flavor,
            "approximation": list(row.approximation),
            "spec": row.spec.model_dump(mode="json")}


def to_json(result: Plan) -> dict[str, Any]:
    """Everything ``render`` shows, as JSON-compatible data."""
    run = result.run
    return {"model": result.model, "params": result.params, "world_size": run.world_size, "nodes": run.nodes,
            "micro_batch": run.micro_batch, "seq_len": run.seq_len, "accumulation": run.accumulation,
            "precision": result.precision, "optimizer": run.optimizer, "device_memory_bytes": result.device_memory,
            "host_memory_bytes": result.host_memory, "method": result.how, "flavor": result.flavor,
            "recommended": result.recommended.name if result.recommended.fits else None,
            "candidates": [_row_json(r) for r in result.rows], "notes": list(result.notes)}
