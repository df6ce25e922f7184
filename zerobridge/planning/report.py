"""A plan as people read it (a table and the recommendation) and as scripts read it (JSON).

    >>> from zerobridge.planning import plan
    >>> from zerobridge.planning.report import render, to_json
    >>> result = plan("tiny-gpt", world_size=2, device_memory="64MiB", micro_batch=2, seq_len=16, workers=1)
    >>> print(render(result).splitlines()[0])
    Plan for tiny-gpt (118,400 parameters) on 2 ranks = 1 node(s) x 2, micro-batch 2 x 16 tokens, bf16, adamw
    >>> to_json(result)["recommended"]
    'zero2'

With ``--flavor all`` the table has one peak column per flavor (``~``: the
flavor's closest form of the candidate, measured as it runs it; ``not
expressible`` / ``not modelled``: the flavor cannot run or the plan cannot
measure it there, never another flavor's figure), host, traffic and fits for
the plan's own flavor, and one recommendation line per flavor, each from its
own column.
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


def _head(result: Plan, peaks_for: str) -> list[str]:
    run = result.run
    return [
        f"Plan for {result.model} ({result.params:,} parameters) on {run.world_size} ranks = {run.nodes} node(s) x "
        f"{run.ranks_per_node}, micro-batch {run.micro_batch} x {run.seq_len} tokens, {result.precision}, "
        f"{run.optimizer}",
        f"device memory {format_bytes(result.device_memory)} per rank"
        + (f", host memory {format_bytes(result.host_memory)} per node" if result.host_memory else "")
        + f"; {result.how}, per rank, fake tensors; {peaks_for}",
        "",
    ]


def _one_flavor(result: Plan) -> list[str]:
    lines = _head(result, f"peaks for the {_FLAVOR_NAMES[result.flavor]}")
    lines.append(f"{'candidate':<30}{'device peak':>12}{'host':>11}{'comm/step':>11}{'model states':>14}  "
                 f"{'formula':<16}fits")
    for row in sorted(result.rows, key=lambda r: (not r.fits, r.comm_bytes, r.host_bytes, r.device_peak)):
        mark = "*" if row.own else "~" if row.approximation else " "
        lines.append(f"{mark}{row.name:<29}{format_bytes(row.device_peak):>12}{format_bytes(row.host_bytes):>11}"
                     f"{format_bytes(row.comm_bytes):>11}{format_bytes(row.model_state_bytes):>14}  "
                     f"{row.explanation.formula:<16}{_fit(row)}")
    return lines


def _peak_cell(result: Plan, name: str, flavor: str) -> str:
    rows = {r.name: r for r in result.rows_for(flavor)}
    if name in rows:
        row = rows[name]
        return ("~" if row.approximation else "") + format_bytes(row.device_peak)
    return result.left_out.get(flavor, {}).get(name, ("not planned", ""))[0]


def _columns(result: Plan) -> list[str]:
    """One peak column per flavor, in candidate order; host, traffic and fits are the plan's flavor's."""
    names = ", ".join(f"{f}: {_FLAVOR_NAMES[f]}" for f in result.flavors)
    lines = _head(result, f"device peak per flavor ({names}); host, comm/step and fits for {result.flavor}")
    lines.append(f"{'candidate':<26}" + "".join(f"{f:>17}" for f in result.flavors)
                 + f"{'host':>11}{'comm/step':>11}{'model states':>14}  {'formula':<16}fits ({result.flavor})")
    own = {r.name: r for r in result.rows}
    for name in result.candidate_names:
        mine = own.get(name)
        is_own = mine.own if mine else any(r.own for f in result.flavors for r in result.rows_for(f) if r.name == name)
        line = ("*" if is_own else " ") + f"{name:<25}" + "".join(f"{_peak_cell(result, name, f):>17}"
                                                                    for f in result.flavors)
        if mine is None:
            line += f"{'-':>11}{'-':>11}{'-':>14}  {'-':<16}-"
        else:
            line += (f"{format_bytes(mine.host_bytes):>11}{format_bytes(mine.comm_bytes):>11}"
                     f"{format_bytes(mine.model_state_bytes):>14}  {mine.explanation.formula:<16}{_fit(mine)}")
        lines.append(line)
    return lines


def _recommendation(result: Plan, flavor: str) -> str:
    best = result.recommended_for(flavor)
    if not best.fits:
        return f"for {flavor}: {no_fit_message(result, flavor)}"
    mark = f" (~ {flavor}'s closest form)" if best.approximation else ""
    return (f"recommended for {flavor}: {best.name}{mark}: {format_bytes(best.device_peak)} of "
            f"{format_bytes(result.device_memory)} per rank ({format_bytes(best.margin)} to spare), "
            f"{format_bytes(best.comm_bytes)} moved per step; the least communication of those that fit, "
            "then the least offload, then no recomputation")


def render(result: Plan) -> str:
    """The table of candidates (one flavor: best first within each group; several: a peak column each, in
    candidate order), and each flavor's recommendation, the plan's own flavor first."""
    several = len(result.flavors) > 1
    lines = _columns(result) if several else _one_flavor(result)
    lines.append("")
    order = [result.flavor, *(f for f in result.flavors if f != result.flavor)]
    lines += [_recommendation(result, f) for f in order if result.rows_for(f)]
    if any(r.own for f in result.flavors for r in result.rows_for(f)):
        lines.append("* your own strategy")
    for f in result.flavors:
        rows = result.rows_for(f)
        approximated = {note: [r.name for r in rows if note in r.approximation] for row in rows
                        for note in row.approximation}
        for note, names in approximated.items():
            lines.append(f"~ {', '.join(names)}: {f} has no exact form; measured as it runs them: {note}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def no_fit_message(result: Plan, flavor: str | None = None) -> str:
    """Why nothing fits on ``flavor`` (default: the plan's), and what would: more ranks, offload, a smaller
    micro-batch."""
    flavor = flavor or result.flavor
    best = result.recommended_for(flavor)
    run = result.run
    what = []
    more = ranks_needed(best, result.device_memory, run)
    if more is not None:
        what.append(f"{best.name} on {more} ranks ({more // run.ranks_per_node} nodes of {run.ranks_per_node})")
    if not best.offloaded:
        offloaded = [r for r in result.rows_for(flavor) if r.offloaded]
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


def _column_json(result: Plan, flavor: str) -> dict[str, Any]:
    best = result.recommended_for(flavor) if result.rows_for(flavor) else None
    return {"recommended": best.name if best is not None and best.fits else None,
            "candidates": [_row_json(r) for r in result.rows_for(flavor)],
            "left_out": {name: {"cell": cell, "reason": why}
                         for name, (cell, why) in result.left_out.get(flavor, {}).items()}}


def _peaks_by_flavor(result: Plan) -> dict[str, dict[str, int | str]]:
    """Candidate -> flavor -> its device peak in bytes, or the cell that stands for it (``not modelled``)."""
    out: dict[str, dict[str, int | str]] = {}
    for name in result.candidate_names or tuple(r.name for r in result.rows):
        cells: dict[str, int | str] = {}
        for f in result.flavors:
            found = [r for r in result.rows_for(f) if r.name == name]
            cells[f] = found[0].device_peak if found else _peak_cell(result, name, f)
        out[name] = cells
    return out


def to_json(result: Plan) -> dict[str, Any]:
    """Everything ``render`` shows, as JSON-compatible data: ``candidates`` and ``recommended`` are the
    plan's flavor's; ``flavors`` has every measured flavor's column and ``device_peak_by_flavor`` each
    candidate's peak per flavor (a string cell where the flavor left it out)."""
    run = result.run
    return {"model": result.model, "params": result.params, "world_size": run.world_size, "nodes": run.nodes,
            "micro_batch": run.micro_batch, "seq_len": run.seq_len, "accumulation": run.accumulation,
            "precision": result.precision, "optimizer": run.optimizer, "device_memory_bytes": result.device_memory,
            "host_memory_bytes": result.host_memory, "method": result.how, "flavor": result.flavor,
            "recommended": result.recommended.name if result.recommended.fits else None,
            "candidates": [_row_json(r) for r in result.rows], "notes": list(result.notes),
            "flavors": {f: _column_json(result, f) for f in result.flavors},
            "device_peak_by_flavor": _peaks_by_flavor(result)}
