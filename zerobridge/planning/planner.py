"""Which strategy fits: every candidate measured on fake tensors, ranked, one recommended.

    >>> from zerobridge.planning import plan
    >>> result = plan("tiny-gpt", world_size=4, device_memory="64MiB", micro_batch=2, seq_len=16, workers=1)
    >>> result.recommended.name, result.recommended.fits
    ('zero2', True)
    >>> row = result.row("zero3"); row.model_state_bytes == row.explanation.model_state_bytes
    True

For each candidate (``candidates``), the engine of the plan's flavor trains
two steps as rank 0 of the world on fake tensors (``flavors``: the native
engine, ``fake_run``; the FSDP2 backend, ``fsdp_fake_run``; DeepSpeed's
buffers beside the native run, ``deepspeed_memory``). A model deeper than
``FULL_DEPTH`` blocks is measured at two shallower depths and every figure
(each phase's peak, the bytes on each tier, the bytes each collective moves)
extended along the line through them to the full depth: every figure but the
peak is exactly linear in the depth of a stack of equal blocks; ``docs/plan.md``
gives the measured error of the peak (``whole=True`` measures the full depth).

Per rank:

- **device peak**: the highest live tensor bytes of any phase, less what the
  engine keeps on the host tier; with the optimizer offloaded, its step runs on
  the host and counts there.
- **host**: model states on the host tier (plus the offloaded step's working set).
- **comm/step**: bus bytes per optimizer step (``explain``'s convention).
- **model states**: ``explain``'s formula for the spec (the ZeRO paper's count).

The recommendation, for the plan's flavor: among the candidates that fit
(device peak within ``device_memory``; host bytes of a node's ranks within
``host_memory``, when given), the least communication, then exact before a
flavor's approximation, then the least offloaded, then no
recomputation, then the smallest peak, then the fewest model-state bytes by
``explain``'s formula (DeepSpeed's stage 1 holds what its stage 2 holds: the
tie goes to stage 2).

``flavor="all"`` measures every candidate on every flavor: ``Plan.columns``
holds each flavor's rows, ``Plan.left_out`` what each flavor cannot plan and
why, ``Plan.recommended_for(flavor)`` each flavor's recommendation from its own
rows; ``rows`` and ``recommended`` are ``recommend_for``'s (default native):

    >>> every = plan("tiny-gpt", world_size=2, device_memory="64MiB", micro_batch=2, seq_len=16, workers=1,
    ...              flavor="all", strategies=["zero2"], only_own=True)
    >>> every.flavors, every.flavor, every.row("zero2", "fsdp2").approximation != ()
    (('native', 'fsdp2', 'deepspeed'), 'native', True)
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from zerobridge.errors import ConfigError
from zerobridge.explain import Explanation, explain
from zerobridge.load import load_spec_for_world
from zerobridge.planning.candidates import Candidate, candidates, deepspeed_form
from zerobridge.planning.fake_run import Measured, Run
from zerobridge.planning.flavors import ALL, NOT_MODELLED, FlavorMeasured, flavors_named, measure_flavor, measure_once
from zerobridge.planning.measure import FULL_DEPTH, SHALLOW
from zerobridge.planning.models import ModelSource, resolve_model
from zerobridge.planning.sizes import parse_bytes
from zerobridge.planning.worker import fork_map, program_map
from zerobridge.spec import OffloadDevice, StrategySpec
from zerobridge.translate.run_level import with_run_settings

__all__ = ["FULL_DEPTH", "SHALLOW", "Plan", "Row", "plan", "ranks_needed"]

@dataclass(frozen=True)
class Row:
    """One candidate's measured cost per rank."""

    name: str
    spec: StrategySpec
    device_peak: int
    host_bytes: int
    comm_bytes: int
    comm_by_kind: dict[str, int]
    model_state_bytes: int
    explanation: Explanation
    peaks: dict[str, int]
    fits: bool
    margin: int
    """``device_memory - device_peak`` (negative: short by that much)."""
    own: bool = False
    flavor: str = "native"
    """The engine that measured it (``flavors``)."""
    approximation: tuple[str, ...] = ()
    """What ``flavor`` ran in place of the spec (FSDP2's closest form of ZeRO-1/2); empty when exact."""

    @property
    def offloaded(self) -> bool:
        """Whether anything lives on the host tier."""
        o = self.spec.offload
        return o.optimizer.device is not OffloadDevice.NONE or o.parameters.device is not OffloadDevice.NONE

    @property
    def recomputes(self) -> bool:
        """Whether activations are recomputed in backward."""
        return self.spec.checkpoint.activation_checkpointing


@dataclass(frozen=True)
class Plan:
    """Every candidate's row, and the one to run."""

    model: str
    params: int
    run: Run
    precision: str
    device_memory: int
    host_memory: int | None
    rows: tuple[Row, ...]
    how: str
    """How the figures were obtained (whole model, or extended from two depths)."""
    notes: tuple[str, ...] = field(default=())
    flavor: str = "native"
    """The engine ``rows`` were measured on, and ``recommended`` holds for (``--flavor``; with ``all``, the
    flavor ``--to`` runs on, else native)."""
    columns: dict[str, tuple[Row, ...]] = field(default_factory=dict)
    """Every flavor measured (one, or all of them with ``--flavor all``) -> its rows, in candidate order."""
    left_out: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    """Flavor -> candidate it cannot plan -> (its cell: ``not expressible`` or ``not modelled``, why)."""
    candidate_names: tuple[str, ...] = ()
    """Every candidate planned, in order, whichever flavors could plan it."""

    @property
    def flavors(self) -> tuple[str, ...]:
        """The flavors measured, in ``FLAVORS`` order."""
        return tuple(self.columns) or (self.flavor,)

    def rows_for(self, flavor: str) -> tuple[Row, ...]:
        """``flavor``'s rows (``KeyError`` when it was not measured)."""
        return self.rows if flavor == self.flavor else self.columns[flavor]

    def row(self, name: str, flavor: str | None = None) -> Row:
        """The row of candidate ``name`` on ``flavor`` (default: the plan's); ``KeyError`` when that flavor
        left it out."""
        for r in self.rows_for(flavor or self.flavor):
            if r.name == name:
                return r
        raise KeyError(name)

    def recommended_for(self, flavor: str) -> Row:
        """``flavor``'s candidate to run, from its own rows: the best of those that fit, else the one
        closest to fitting."""
        rows = self.rows_for(flavor)
        fitting = [r for r in rows if r.fits]
        if not fitting:
            return max(rows, key=lambda r: r.margin)
        return min(fitting, key=lambda r: (r.comm_bytes, bool(r.approximation), r.host_bytes, r.recomputes,
                                           r.device_peak, r.model_state_bytes))

    @property
    def recommended(self) -> Row:
        """The candidate to run on the plan's flavor (``recommended_for(flavor)``)."""
        return self.recommended_for(self.flavor)


def _measure_all(model: object, source: ModelSource, jobs: list[tuple[StrategySpec, str]], run: Run,
                 workers: int, whole: bool) -> list[FlavorMeasured]:
    """Every (spec, flavor) of ``jobs`` measured, each run that trains alike once (``measure_once``)."""
    return measure_once(jobs, run, lambda unique: _measure_each(model, source, unique, run, workers, whole))


def _measure_each(model: object, source: ModelSource, jobs: list[tuple[StrategySpec, str]], run: Run,
                  workers: int, whole: bool) -> list[FlavorMeasured]:
    """Every (spec, flavor) of ``jobs`` measured; in ``workers`` processes (each holding its own fake process
    group): forked from this one (``worker.fork_map``), else fresh ones when the model is named by a string."""
    if workers <= 1 or len(jobs) < 2:
        return [measure_flavor(source, spec, run, whole, flavor) for spec, flavor in jobs]
    forked = fork_map(lambda i: measure_flavor(source, jobs[i][0], run, whole, jobs[i][1]), len(jobs),
                      workers=workers)
    if forked is not None:
        return forked
    if not isinstance(model, (str, Path)):
        return [measure_flavor(source, spec, run, whole, flavor) for spec, flavor in jobs]
    # Each worker is a program of its own (``planning.worker``): a fresh interpreter that never
    # re-imports the caller's script, so a plain script needs no ``__main__`` guard.
    return program_map(str(model), [spec for spec, _ in jobs], run, whole, [f for _, f in jobs], workers=workers)


def _row(candidate: Candidate, measured: Measured, *, params: int, run: Run, device_memory: int,
         host_memory: int | None, flavor: str = "native", approximation: tuple[str, ...] = ()) -> Row:
    spec = candidate.spec
    host_states = measured.tiers.get("host", 0)
    # what the flavor ran: FSDP2 has no optimizer-only offload, and runs that candidate on the device
    offloaded_step = spec.offload.optimizer.device is not OffloadDevice.NONE and host_states > 0
    # ``setup`` is left out: a meta model's values are drawn on the host, one module at a time.
    phases = {k: v for k, v in measured.peaks.items() if k != "setup" and not (offloaded_step and k == "step")}
    device_peak = max(phases.values(), default=0) - host_states
    host = host_states
    if offloaded_step and "step" in measured.peaks:
        at_rest = measured.tiers.get("device", 0) + host_states
        host += max(0, measured.peaks["step"] - at_rest)
    explanation = explain(spec, params=params, world_size=run.world_size, local_world_size=run.ranks_per_node,
                          optimizer="sgd" if run.optimizer == "sgd" else "adam")
    fits = device_peak <= device_memory and (host_memory is None or host * run.ranks_per_node <= host_memory)
    return Row(name=candidate.name, spec=spec, device_peak=device_peak, host_bytes=host,
               comm_bytes=sum(measured.comm_bytes.values()), comm_by_kind=dict(measured.comm_bytes),
               model_state_bytes=explanation.model_state_bytes, explanation=explanation,
               peaks=dict(measured.peaks), fits=fits, margin=device_memory - device_peak, own=candidate.own,
               flavor=flavor, approximation=approximation)


def _source(model: str | Path | ModelSource | nn.Module) -> ModelSource:
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, nn.Module):
        template = model.to("meta") if all(p.is_meta for p in model.parameters()) else copy.deepcopy(model).to("meta")
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        return ModelSource(type(model).__name__, lambda depth: copy.deepcopy(template), None,
                           int(vocab) if isinstance(vocab, int) else 2, None,
                           hf=hasattr(model, "config") and hasattr(model, "post_init"))
    return resolve_model(str(model))


def _check_run(source: ModelSource, run: Run) -> None:
    for name, value in (("world_size", run.world_size), ("nodes", run.nodes), ("micro_batch", run.micro_batch),
                        ("seq_len", run.seq_len), ("accumulation", run.accumulation)):
        if value < 1:
            raise ConfigError(f"{name}={value}: must be at least 1", key=f"--{name.replace('_', '-')}")
    if run.world_size % run.nodes:
        raise ConfigError(f"--world-size {run.world_size} is not a multiple of --nodes {run.nodes}: the hybrid "
                          "layouts shard inside a node and need the same ranks on every node", key="--nodes",
                          fix=f"use a world size divisible by {run.nodes}, or --nodes that divides "
                              f"{run.world_size}")
    if source.max_seq_len is not None and run.seq_len > source.max_seq_len:
        raise ConfigError(f"--seq-len {run.seq_len} is longer than {source.name}'s {source.max_seq_len} positions",
                          key="--seq-len", fix=f"use at most {source.max_seq_len}")


def _own(strategies: Sequence[str | Path | StrategySpec], world_size: int) -> tuple[Candidate, ...]:
    out = []
    for item in strategies:
        spec = item if isinstance(item, StrategySpec) else load_spec_for_world(item, world_size, flag="--world-size")
        if OffloadDevice.NVME in (spec.offload.optimizer.device, spec.offload.parameters.device):
            raise ConfigError(f"{item}: NVMe tiers are not planned (the planning run writes no swap files)",
                              key="offload", fix="plan its cpu form (offload device \"cpu\"): the device peak is "
                                                 "the same, the host figure is then an upper bound")
        name = spec.name or (Path(str(item)).stem if not isinstance(item, StrategySpec) else "own")
        out.append(Candidate(name, spec, own=True))
    return tuple(out)


def plan(model: str | Path | ModelSource | nn.Module, *, world_size: int, device_memory: int | str,
         micro_batch: int = 1, seq_len: int = 2048, nodes: int = 1, host_memory: int | str | None = None,
         precision: str = "bf16", accumulation: int = 1, optimizer: str = "adamw",
         strategies: Sequence[str | Path | StrategySpec] = (), only_own: bool = False,
         workers: int | None = None, whole: bool = False, flavor: str = "native",
         recommend_for: str | None = None) -> Plan:
    """Measure every candidate layout of ``model`` on ``world_size`` ranks over ``nodes`` nodes and
    rank them (module docstring).

    Args:
        model: a built-in name, a Hugging Face config.json or model directory, ``pkg.module:factory``,
            a ``ModelSource``, or an ``nn.Module`` (copied to the meta device).
        device_memory: each rank's accelerator memory (bytes, or ``"80GiB"``, ``"80GB"``).
        host_memory: each node's host memory (same forms); ``None``: not checked.
        precision: ``fp32``, ``bf16`` or ``fp16`` compute (16-bit: fp32 master weights).
        strategies: the user's own configs, registry names or specs, planned beside the candidates.
        only_own: plan only ``strategies`` (and their ``+ac`` forms).
        workers: processes measuring candidates side by side (default: the CPUs, at most 4; 1: this one).
        whole: measure every candidate at the model's full depth, never extended from two shallow
            ones (slower: about 15 s per candidate for a 70B model here).
        flavor: the engine the figures are for: ``native`` (zerobridge's), ``fsdp2`` (the FSDP2
            backend, on fake tensors), ``deepspeed`` (DeepSpeed's buffers modelled on the native
            run); see ``flavors``. ``all``: every one, a column each (``Plan.columns``).
        recommend_for: the flavor ``rows`` and ``recommended`` are for, one of those planned (default:
            ``flavor``; with ``all``, native; ``plan --flavor all --to X`` passes the flavor X runs on).
    """
    measured_on = flavors_named(flavor)
    primary = recommend_for or (flavor if flavor != ALL else "native")
    if primary not in measured_on:
        raise ConfigError(f"recommend_for={primary!r} is not among the flavors planned ({', '.join(measured_on)})",
                          key="--flavor", fix=f"use --flavor {primary} or --flavor {ALL}")
    source = _source(model)
    device_bytes = parse_bytes(device_memory, key="--device-memory")
    host_bytes = None if host_memory is None else parse_bytes(host_memory, key="--host-memory")
    run = Run(world_size=world_size, nodes=nodes, micro_batch=micro_batch, seq_len=seq_len,
              accumulation=accumulation, optimizer=optimizer)
    _check_run(source, run)
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--precision {precision!r}", key="--precision", fix="use fp32, bf16 or fp16")
    template = source.build(min(source.layers or 1, 2) if source.layers else None)
    own = _own(strategies, world_size)
    made = candidates(template, nodes=nodes, ranks_per_node=run.ranks_per_node, own=own)
    chosen = [c for c in made if c.own or not only_own]
    if not chosen:
        raise ConfigError("--only-own without --config or --strategy: nothing to plan", key="--only-own",
                          fix="name a config or strategy, or drop --only-own")
    params = source.params
    specs = [with_run_settings(c.spec, micro_batch=micro_batch, accumulation=accumulation,
                               precision=precision).value.model_copy(update={"name": c.name}) for c in chosen]
    # DeepSpeed is measured as --to deepspeed writes it: buckets sized for the model
    ds_specs = ([deepspeed_form(spec, template, own=c.own)[0] for c, spec in zip(chosen, specs)]
                if "deepspeed" in measured_on else specs)
    jobs = [(ds if f == "deepspeed" else spec, f) for f in measured_on for spec, ds in zip(specs, ds_specs)]
    count = min(os.cpu_count() or 1, 4) if workers is None else workers
    results = iter(_measure_all(model, source, jobs, run, count, whole))
    columns: dict[str, tuple[Row, ...]] = {}
    left_out: dict[str, dict[str, tuple[str, str]]] = {}
    notes: list[str] = []
    for f in measured_on:
        rows, refused = [], {}
        for c, spec in zip(chosen, ds_specs if f == "deepspeed" else specs):
            m = next(results)
            if m.measured is None:
                refused[c.name] = (m.cell or NOT_MODELLED, str(m.refused))
                continue
            rows.append(_row(Candidate(c.name, spec, c.own), m.measured, params=params, run=run,
                             device_memory=device_bytes, host_memory=host_bytes, flavor=f,
                             approximation=m.approximation))
        columns[f], left_out[f] = tuple(rows), refused
        by_reason: dict[tuple[str, str], list[str]] = {}
        for name, cell in refused.items():
            by_reason.setdefault(cell, []).append(name)
        notes += [f"{f} leaves out {', '.join(names)} ({cell}): {why}" for (cell, why), names in by_reason.items()]
    if precision == "fp16" and columns.get("deepspeed"):
        notes.append("deepspeed: fp16 is modelled as bf16 (its loss scaler's overflow checks are not), and not "
                     "checked against real DeepSpeed (its CPU accelerator has no fp16 here)")
    if not columns[primary]:
        first = next(iter(left_out[primary].values()))[1]
        raise ConfigError(f"no candidate can be planned on {primary}: {first}", key="--flavor",
                          fix=f"plan with --flavor native, or choose candidates {primary} runs")
    deep = source.layers is not None and source.layers > FULL_DEPTH and not whole
    how = (f"measured at {SHALLOW[0]} and {SHALLOW[1]} of {source.layers} blocks, extended to {source.layers}"
           if deep else "measured on the whole model")
    return Plan(model=source.name, params=params, run=run, precision=precision, device_memory=device_bytes,
                host_memory=host_bytes, rows=columns[primary], how=how, notes=tuple(notes), flavor=primary,
                columns=columns, left_out=left_out, candidate_names=tuple(c.name for c in chosen))


def ranks_needed(row: Row, device_memory: int, run: Run) -> int | None:
    """The smallest world size (a multiple of the ranks per node) at which ``row``'s layout fits,
    with its model states scaled by ``explain``'s formula; ``None`` if none up to 65,536 ranks."""
    other = row.device_peak - row.explanation.bytes_per_tier().get("accelerator", 0)
    step = run.ranks_per_node
    world = run.world_size
    while world <= 65536:
        world += step
        try:
            states = explain(row.spec, params=row.explanation.params, world_size=world,
                             local_world_size=run.ranks_per_node).bytes_per_tier().get("accelerator", 0)
        except ConfigError:
            continue
        if states + other <= device_memory:
            return world
    return None
