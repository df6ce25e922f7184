"""``compare``: the same training on several stages and backends, side by side.

    >>> from zerobridge.compare import compare
    >>> result = compare(stages=[3], backends=["native"], nproc=1, steps=2)  # doctest: +SKIP
    >>> result.ok, result.runs[0].planned.name                               # doctest: +SKIP
    (True, 'native/stage3')

``zerobridge compare`` is this function plus output files; ``bench/`` calls
it too. Every input is checked before a process starts (``ConfigError``
naming the argument and the fix); a run that then fails or diverges is a
result, reported in the ``Comparison``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zerobridge.compare.peaks import PlannedPeak
from zerobridge.compare.report import Comparison, compute_dtype, relative, run_kind
from zerobridge.compare.runner import Planned, RunOutcome, execute, plan_runs
from zerobridge.compare.tolerance import FACTOR, LOSS_FLOOR, NORM_FLOOR, Tolerance, calibrated
from zerobridge.compare.workload import BUILTIN, resolve_model
from zerobridge.env import BACKENDS
from zerobridge.errors import ConfigError
from zerobridge.explain import explain, format_bytes
from zerobridge.spec import ShardingSpec, StrategySpec, WireSpec

__all__ = ["Plan", "compare", "plan", "run_plan"]

STAGES = (0, 1, 2, 3)
OptimizerKind = Literal["adam", "sgd"]
"""The optimizers the ZeRO formulas know (``explain``'s ``optimizer``)."""


def _check(stages: Sequence[int], backends: Sequence[str], nproc: int, steps: int, tolerance: float | None,
           norm_tolerance: float | None) -> None:
    for stage in stages:
        if stage not in STAGES:
            raise ConfigError(f"--stages {stage}: a ZeRO stage is 0, 1, 2 or 3", key="--stages")
    for backend in backends:
        if backend not in BACKENDS:
            raise ConfigError(f"--backends {backend}: unknown backend", key="--backends",
                              fix=f"choose from {', '.join(BACKENDS)}")
    if len(set(backends)) != len(backends) or len(set(stages)) != len(stages):
        raise ConfigError("a stage or backend is named twice", key="--stages/--backends", fix="name each once")
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: need at least one process", key="--nproc")
    if steps < 1:
        raise ConfigError(f"--steps {steps}: need at least one step", key="--steps")
    for flag, value in (("--tolerance", tolerance), ("--norm-tolerance", norm_tolerance)):
        if value is not None and not value >= 0:
            raise ConfigError(f"{flag} {value}: must be a non-negative number", key=flag)


def _optimizer_kind(optimizer: object) -> OptimizerKind | None:
    import torch

    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD) and all(g.get("momentum") for g in optimizer.param_groups):
        return "sgd"
    return None


@dataclass(frozen=True)
class Plan:
    """A checked comparison, before any run."""

    comparison: Comparison
    """Empty runs; the skipped pairs filled in."""
    runs: list[Planned]
    optimizer: OptimizerKind | None
    """``adam`` or ``sgd`` (with momentum) for the ZeRO formulas; None for other optimizers."""
    model: str
    global_batch: int | None
    seq_len: int | None
    seed: int
    exact_only: bool
    """Skip what a backend can only approximate (else run its closest form, marked)."""
    planned_peaks: tuple[PlannedPeak, ...] = ()
    """Per run, the plan's peak (``plan_memory``); empty: the runs do not count their peaks."""


def plan(*, stages: Sequence[int] | None = None, configs: Sequence[str | Path] = (),
         backends: Sequence[str] = BACKENDS, nproc: int = 2, steps: int = 20, model: str = BUILTIN,
         global_batch: int | None = None, seq_len: int | None = None, tolerance: float | None = None,
         norm_tolerance: float | None = None, seed: int = 0, exact_only: bool = False, compile: bool = False,
         plan_memory: bool = False) -> Plan:
    """Check the inputs, build the workload once (in this process) and plan the runs. What a
    backend can only approximate runs in its closest form (``Planned.approximations``)
    unless ``exact_only``, which skips it. ``compile``: every run under ``torch.compile``.
    ``tolerance`` / ``norm_tolerance``: fixed relative bounds for every run; ``None``: 1e-5 and
    1e-4 for fp32 runs, and for bf16/fp16 runs bounds calibrated after them (``tolerance.py``).
    ``plan_memory``: plan each run's peak on its backend's flavor now (``compare.plan_memory``) and have
    the runs count theirs the same way."""
    chosen_stages = list(STAGES if stages is None and not configs else stages or [])
    _check(chosen_stages, list(backends), nproc, steps, tolerance, norm_tolerance)
    work = resolve_model(model, global_batch=global_batch, seq_len=seq_len)(seed)
    if work.global_batch % nproc:
        raise ConfigError(f"the global batch of {work.global_batch} rows does not split over {nproc} processes",
                          key="--nproc", fix="choose a --nproc that divides it, or change --global-batch")
    params = sum(p.numel() for p in work.model.parameters() if p.requires_grad)
    kind = _optimizer_kind(work.optimizer(work.model))
    runs, skipped = plan_runs(stages=chosen_stages, configs=configs, backends=backends, world_size=nproc,
                              allow_approximate=not exact_only, compile=compile)
    if not runs:
        raise ConfigError("nothing to compare: every combination was skipped", key="--backends",
                          fix="; ".join(f"{s.backend}/{s.label}: {s.reason}" for s in skipped) or None)
    rows = work.global_batch // nproc
    for run in runs:
        if rows % run.accumulation:
            raise ConfigError(f"{run.label} accumulates {run.accumulation} micro-batches per step, but each of "
                              f"{nproc} processes gets {rows} rows of the global batch of {work.global_batch}",
                              key="--global-batch",
                              fix=f"make the global batch a multiple of {nproc * run.accumulation} "
                                  "(--nproc x the accumulation steps), or change the config's accumulation")
    comparison = Comparison(runs=[], skipped=skipped, tolerance=LOSS_FLOOR if tolerance is None else tolerance,
                            norm_tolerance=NORM_FLOOR if norm_tolerance is None else norm_tolerance,
                            model=model, params=params, world_size=nproc, steps=steps, compiled=compile,
                            derived=(tolerance is None, norm_tolerance is None))
    peaks: list[PlannedPeak] = []
    if plan_memory:
        from zerobridge.compare.plan_memory import planned_peaks  # lazy: loads FSDP2 and the fake runs (~1 s)

        peaks = planned_peaks(runs, model=model, rows=rows, seq_len=work.batch(0)[0].shape[-1], world_size=nproc,
                              optimizer=kind)
    return Plan(comparison, runs, kind, model, global_batch, seq_len, seed, exact_only, tuple(peaks))


def _formulas(outcome: RunOutcome, params: int, optimizer: OptimizerKind | None) -> None:
    if optimizer is None:
        return
    spec, stage = outcome.planned.spec, outcome.planned.formula_stage
    if stage is not None:  # a closest form: judged against the formulas of the stage it stands for
        spec = spec.model_copy(update={"sharding": ShardingSpec.for_stage(stage)})
    told = explain(spec, params=params, world_size=outcome.world_size, optimizer=optimizer)
    outcome.formula_model_state_bytes = told.model_state_bytes
    outcome.formula_comm_bytes = told.comm_bytes_per_step


def compare(*, stages: Sequence[int] | None = None, configs: Sequence[str | Path] = (),
            backends: Sequence[str] = BACKENDS, nproc: int = 2, steps: int = 20, model: str = BUILTIN,
            global_batch: int | None = None, seq_len: int | None = None, tolerance: float | None = None,
            norm_tolerance: float | None = None, clip: float | None = 1.0, seed: int = 0, exact_only: bool = False,
            compile: bool = False, timeout_s: float = 900.0, plan_memory: bool = False,
            progress: Callable[[int, int, RunOutcome], None] | None = None) -> Comparison:
    """Train ``model`` for ``steps`` steps on every stage (default 0-3 when no ``configs``) and
    config, on every backend, each in a fresh group of ``nproc`` processes; compare the runs.

    ``progress(index, total, outcome)`` is called after each run. ``plan_memory``: each run also
    reports the peak ``zerobridge plan`` gives its spec and its own, counted the same way
    (``RunOutcome.planned_peak``, ``RunOutcome.peak_bytes``).
    """
    planned = plan(stages=stages, configs=configs, backends=backends, nproc=nproc, steps=steps, model=model,
                   global_batch=global_batch, seq_len=seq_len, tolerance=tolerance,
                   norm_tolerance=norm_tolerance, seed=seed, exact_only=exact_only, compile=compile,
                   plan_memory=plan_memory)
    return run_plan(planned, clip=clip, timeout_s=timeout_s, progress=progress)


def run_plan(planned: Plan, *, clip: float | None = 1.0, timeout_s: float = 900.0,
             progress: Callable[[int, int, RunOutcome], None] | None = None) -> Comparison:
    """Execute a ``plan`` and fill its comparison in."""
    comparison = planned.comparison

    def report(index: int, outcome: RunOutcome) -> None:
        _formulas(outcome, comparison.params, planned.optimizer)
        if planned.planned_peaks:
            outcome.planned_peak = planned.planned_peaks[index]
        if progress is not None:
            progress(index, len(planned.runs), outcome)

    comparison.runs = execute(planned.runs, model=planned.model, global_batch=planned.global_batch,
                              seq_len=planned.seq_len, world_size=comparison.world_size, steps=comparison.steps,
                              seed=planned.seed, clip=clip, allow_approximate=not planned.exact_only,
                              timeout_s=timeout_s, track_peaks=bool(planned.planned_peaks), progress=report)
    if any(comparison.derived):
        _calibrate(planned, comparison, clip=clip, timeout_s=timeout_s)
    return comparison


def _calibrate(planned: Plan, comparison: Comparison, *, clip: float | None, timeout_s: float) -> None:
    """For each 16-bit compute dtype run: its first finished run's spec once more in one process
    (stage 0: every reduction in another order); its drift from that run sets the bounds."""

    for dtype in ("bf16", "fp16"):
        first = next((r for r in comparison.runs if r.error is None and compute_dtype(r.planned.spec) == dtype
                      and not r.planned.spec.communication.wire.quantized), None)  # quantized kinds: their own
        if first is None:
            continue
        # The same micro-batches per step (each twice as many rows, on the one rank), whatever
        # micro-batch size and global batch the config wrote for its own world size.
        batch = first.planned.spec.batch.model_copy(update={
            "accumulation_steps": first.planned.accumulation, "micro_batch_size": None, "global_batch_size": None})
        spec = StrategySpec(precision=first.planned.spec.precision, batch=batch)
        rerun = Planned(f"calibration/{dtype}", "native", f"calibration-{dtype}", 0, spec, by_stage=False,
                        accumulation=first.planned.accumulation)
        (outcome,) = execute([rerun], model=planned.model, global_batch=planned.global_batch,
                             seq_len=planned.seq_len, world_size=1, steps=comparison.steps, seed=planned.seed,
                             clip=clip, timeout_s=timeout_s)
        if outcome.error is not None:
            raise ConfigError(f"the one-process {dtype} rerun that calibrates the tolerances failed: "
                              f"{outcome.error}", key="--tolerance",
                              fix="pass --tolerance and --norm-tolerance to judge with fixed bounds")
        comparison.tolerances[dtype] = calibrated(
            loss_deviation=[relative(a, b) for a, b in zip(outcome.losses, first.losses)],
            norm_deviation=[relative(a, b) for a, b in zip(outcome.grad_norms, first.grad_norms)], dtype=dtype)
    _calibrate_quantized(planned, comparison, clip=clip, timeout_s=timeout_s)


def _calibrate_quantized(planned: Plan, comparison: Comparison, *, clip: float | None, timeout_s: float) -> None:
    """For each kind of quantized run (``run_kind``): its first finished run once more with every
    payload in full precision, on the same ranks; its drift from that twin sets the bounds, the
    twin's bytes stand beside it."""
    for kind in dict.fromkeys(run_kind(r.planned.spec) for r in comparison.runs if r.error is None):
        first = next(r for r in comparison.runs if r.error is None and run_kind(r.planned.spec) == kind)
        spec = first.planned.spec
        if not spec.communication.wire.quantized:
            continue
        full = spec.model_copy(update={"communication": spec.communication.model_copy(
            update={"wire": WireSpec()})})
        twin = Planned(f"calibration/{kind}", "native", f"unquantized-{first.planned.label}", first.planned.stage,
                       full, by_stage=False, accumulation=first.planned.accumulation)
        (outcome,) = execute([twin], model=planned.model, global_batch=planned.global_batch,
                             seq_len=planned.seq_len, world_size=comparison.world_size, steps=comparison.steps,
                             seed=planned.seed, clip=clip, timeout_s=timeout_s)
        if outcome.error is not None:
            raise ConfigError(f"the unquantized rerun that calibrates {kind} runs failed: {outcome.error}",
                              key="--tolerance", fix="pass --tolerance and --norm-tolerance to judge with fixed "
                                                     "bounds")
        moved = sum(first.comm_bytes.values())
        exact = sum(outcome.comm_bytes.values())
        bounds = calibrated(
            loss_deviation=[relative(a, b) for a, b in zip(first.losses, outcome.losses)],
            norm_deviation=[relative(a, b) for a, b in zip(first.grad_norms, outcome.grad_norms)], dtype=kind)
        comparison.tolerances[kind] = Tolerance(
            bounds.loss, bounds.grad_norm,
            f"{kind}: {FACTOR:g} x the drift of {first.planned.name} from the same run unquantized, up to each "
            f"step; it moves {moved / max(exact, 1):.2f}x the unquantized run's bytes per step "
            f"({format_bytes(int(moved))} vs {format_bytes(int(exact))})")
