"""Plan the runs of a comparison, start a fresh process group for each, merge what the ranks measured.

    >>> from zerobridge.compare.runner import plan_runs
    >>> runs, skipped = plan_runs(stages=[0, 3], configs=[], backends=["native", "fsdp"], world_size=2)
    >>> [r.name for r in runs]
    ['native/stage0', 'fsdp/stage0', 'native/stage3', 'fsdp/stage3']
    >>> runs, skipped = plan_runs(stages=[1], configs=[], backends=["native", "fsdp"], world_size=2)
    >>> [r.name for r in runs], [(s.backend, s.stage) for s in skipped]
    (['native/stage1'], [('fsdp', 1)])
    >>> runs, _ = plan_runs(stages=[1], configs=[], backends=["fsdp"], world_size=2, allow_approximate=True)
    >>> [(r.name, r.approximations, r.formula_stage) for r in runs]
    [('fsdp/stage1', ('sharding',), 2)]

Each run gets its own ``Cluster`` (spawned processes, one default group),
torn down before the next starts: peak memory is then the run's own, and
nothing a backend changes process-wide (DeepSpeed stage 3 replaces
``torch.nn.functional.linear``) reaches the next run. A run that fails is
reported with its ranks' last error line and the path of what its ranks
printed (kept only for failed runs); the others still run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from zerobridge.backends.preflight import formula_stage, preflight
from zerobridge.compare.peaks import PlannedPeak, TrackedRecord
from zerobridge.compare.worker import RankRecord
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import PRELOAD, Cluster
from zerobridge.load import load_spec_for_world
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage

__all__ = ["Planned", "RunOutcome", "Skipped", "after_warmup", "execute", "plan_runs"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Planned:
    """One (spec, backend) pair to run."""

    name: str
    """``backend/label``, e.g. ``deepspeed/stage2`` or ``fsdp/ds_zero3`` (a config's file stem)."""
    backend: str
    label: str
    """``stageN`` or the config's file stem."""
    stage: int
    """The spec's ZeRO stage."""
    spec: StrategySpec
    """For a stage, ``spec_for_stage(N)`` without the model: the ranks ask ``prepare(stage=N)``,
    which also picks the wrap units from the model (per layer when it names its layers)."""
    by_stage: bool
    """Whether the ranks pass ``stage=`` (True) or ``config=spec`` (False) to ``prepare``."""
    approximations: tuple[str, ...] = ()
    """Spec keys the backend runs approximately (none with ``exact_only``)."""
    formula_stage: int | None = None
    """The ZeRO stage whose formulas a closest form is measured against (FSDP2's form of
    ZeRO-1 and ZeRO-2: ZeRO-2's); None: the spec's own."""
    accumulation: int = 1
    """Micro-batches per optimizer step at the run's world size (``batch.accumulation_for``): each
    rank cuts its share of a step's batch into this many and steps once, at the boundary."""


@dataclass(frozen=True)
class Skipped:
    """A pair the backend cannot express, with its reason."""

    backend: str
    stage: int
    label: str
    reason: str


@dataclass
class RunOutcome:
    """One finished (or failed) run, merged over its ranks."""

    planned: Planned
    world_size: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes per collective kind per step: the median over the measured steps, the largest rank's."""
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    """``params``, ``grads``, ``optimizer``: the largest rank's, as the engine reports them."""
    live_bytes: dict[str, int] = field(default_factory=dict)
    """The same measured independently for every engine (``compare.memory``): live storages by role,
    ``params``, ``grads``, ``optimizer``, ``other``, the largest rank's."""
    tier_bytes: dict[str, int] = field(default_factory=dict)
    formula_model_state_bytes: int | None = None
    """What ``zerobridge explain`` says a rank holds (Adam-type optimizers only)."""
    formula_comm_bytes: int | None = None
    """What ``zerobridge explain`` says a rank moves per step (Adam-type optimizers only)."""
    peak_rss_bytes: int = 0
    """The largest rank's high-water resident set."""
    steps_peak_rss_bytes: int | None = None
    """The largest rank's high-water resident set during the training steps alone."""
    baseline_rss_bytes: int = 0
    approximations: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    """Why the run failed (None when it finished)."""
    wall_s: float = 0.0
    """Seconds from starting the processes to the last result."""
    peak_bytes: list[int] = field(default_factory=list)
    """Per rank: peak live tensor bytes over the training steps, counted as the plan counts them
    (``--plan-memory`` only; ``compare.peaks``)."""
    planned_peak: PlannedPeak | None = None
    """What ``zerobridge plan`` says the run peaks at (``--plan-memory`` only; ``compare.plan_memory``)."""

    @property
    def step_time_s(self) -> float:
        """Median step time over the steps after warm-up (``after_warmup``)."""
        times = after_warmup(self.step_times)
        return statistics.median(times) if times else float("nan")


def after_warmup(per_step: Sequence[_T]) -> Sequence[_T]:
    """The steps a median is taken over: all but the first (warm-up) when there are three or more."""
    return per_step[1:] if len(per_step) >= 3 else per_step


def _labelled(stages: Sequence[int], configs: Sequence[str | Path], compile: bool = False,
              world_size: int | None = None) -> list[tuple[str, StrategySpec, bool]]:
    def compiled(spec: StrategySpec) -> StrategySpec:
        return spec.model_copy(update={"compile": spec.compile.model_copy(update={"enabled": True})}) \
            if compile else spec

    specs = [(f"stage{s}", compiled(spec_for_stage(s)), True) for s in stages]
    seen = {label for label, _, _ in specs}
    for config in configs:
        label = Path(config).stem if Path(config).suffix else str(config)
        while label in seen:
            label += "'"
        seen.add(label)
        specs.append((label, compiled(load_spec_for_world(config, world_size, flag="--nproc")), False))
    return specs


def plan_runs(*, stages: Sequence[int], configs: Sequence[str | Path], backends: Sequence[str], world_size: int,
              allow_approximate: bool = False, compile: bool = False) -> tuple[list[Planned], list[Skipped]]:
    """Every stage and config on every backend, grouped by spec in the order given; what a
    backend cannot express at ``world_size`` is skipped with the reason. A config that does
    not load raises ``ConfigError``. ``compile``: every spec with ``compile.enabled``."""

    runs: list[Planned] = []
    skipped: list[Skipped] = []
    for label, spec, by_stage in _labelled(stages, configs, compile, world_size):
        stage = spec.sharding.stage.value
        try:
            accumulation = spec.batch.accumulation_for(world_size)
        except ConfigError as exc:  # the batch arithmetic fails the same way on every backend: bad input
            raise ConfigError(exc.message, source=label, key=exc.key, fix=exc.fix) from None
        for backend in backends:
            try:
                found = preflight(backend, spec, world_size=world_size, allow_approximate=allow_approximate)
            except ConfigError as exc:
                reason = f"{exc.key}: {exc.message}" if exc.key else exc.message
                skipped.append(Skipped(backend, stage, label, reason))
                continue
            runs.append(Planned(f"{backend}/{label}", backend, label, stage, spec, by_stage,
                                tuple(e.key for e in found), formula_stage(backend, spec, found), accumulation))
    return runs, skipped


def _merge(planned: Planned, records: list[RankRecord], world_size: int) -> RunOutcome:
    first = records[0]
    kinds = sorted({k for r in records for step in r.comm_bytes for k in step})
    comm = {k: max(statistics.median([step.get(k, 0) for step in after_warmup(r.comm_bytes)]) for r in records)
            for k in kinds}
    return RunOutcome(
        planned=planned, world_size=world_size, losses=first.losses, grad_norms=first.grad_norms,
        step_times=first.step_times, comm_bytes={k: float(v) for k, v in comm.items() if v},
        model_state_bytes={k: max(r.model_state_bytes.get(k, 0) for r in records) for k in first.model_state_bytes},
        tier_bytes={k: max(r.tier_bytes.get(k, 0) for r in records) for k in first.tier_bytes},
        peak_rss_bytes=max(r.peak_rss_bytes for r in records),
        steps_peak_rss_bytes=None if any(r.steps_peak_rss_bytes is None for r in records)
        else max(r.steps_peak_rss_bytes or 0 for r in records),
        baseline_rss_bytes=max(r.baseline_rss_bytes for r in records),
        live_bytes={k: max(r.live_bytes.get(k, 0) for r in records) for k in first.live_bytes},
        approximations=first.approximations)


def _last_error(exc: Exception) -> str:
    tracebacks: dict[int, str] = getattr(exc, "tracebacks", {})
    for rank, text in sorted(tracebacks.items()):
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if lines:
            return f"rank {rank}: {lines[-1].strip()}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def worker_env() -> dict[str, str]:
    """What the ranks need beyond the parent's environment: DeepSpeed's CPU accelerator on a
    machine without CUDA (DeepSpeed would otherwise probe for one)."""
    import torch

    env: dict[str, str] = {}
    if not torch.cuda.is_available() and "DS_ACCELERATOR" not in os.environ:
        env["DS_ACCELERATOR"] = "cpu"
    return env


DEEPSPEED_PRELOAD = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer")
"""DeepSpeed's modules a DeepSpeed run imports as its engine starts: about 6 s per rank at every run
otherwise (its ZeRO optimizer check imports the Muon optimizer, whose ``torch.compile`` decorators
import inductor)."""


def _preload(backend: str) -> tuple[str, ...]:
    """What a run's workers find imported when they start (``Cluster``'s ``preload``): compare's worker,
    and DeepSpeed's engine modules for a DeepSpeed run."""
    return (*PRELOAD, "zerobridge.compare.worker", *(DEEPSPEED_PRELOAD if backend == "deepspeed" else ()))


def _choice(run: Planned) -> dict[str, Any]:
    """What the ranks pass to ``prepare`` besides the backend."""
    if not run.by_stage:
        return {"config": run.spec}
    return {"stage": run.stage, "compile": True} if run.spec.compile.enabled else {"stage": run.stage}


def execute(runs: Sequence[Planned], *, model: str, global_batch: int | None, seq_len: int | None,
            world_size: int, steps: int, seed: int = 0, clip: float | None = 1.0,
            allow_approximate: bool = False, timeout_s: float = 900.0, track_peaks: bool = False,
            progress: Callable[[int, RunOutcome], None] | None = None) -> list[RunOutcome]:
    """Run each planned pair in a fresh process group of ``world_size`` ranks. ``track_peaks``: each
    rank also counts its peak live tensor bytes (``compare.peaks``, into ``RunOutcome.peak_bytes``)."""
    import time

    import torch


    group = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    logs = Path(tempfile.mkdtemp(prefix="zerobridge-compare-"))
    outcomes: list[RunOutcome] = []
    for index, run in enumerate(runs):
        start = time.perf_counter()
        log = logs / run.name.replace("/", "-")
        kwargs: dict[str, Any] = {"log": str(log), "model": model, "global_batch": global_batch, "seq_len": seq_len,
                                  "choice": _choice(run),
                                  "backend": run.backend, "steps": steps, "seed": seed, "clip": clip,
                                  "allow_approximate": allow_approximate, "accumulation": run.accumulation}
        try:
            with Cluster(world_size, timeout_s=timeout_s, backend=group, env=worker_env(),
                         preload=_preload(run.backend)) as cluster:
                records = cluster.run("zerobridge.compare.peaks:train" if track_peaks
                                      else "zerobridge.compare.worker:train", **kwargs)
            tracked = [r for r in records if isinstance(r, TrackedRecord)]
            outcome = _merge(run, [r.record if isinstance(r, TrackedRecord) else r for r in records
                                   if isinstance(r, (RankRecord, TrackedRecord))], world_size)
            outcome.peak_bytes = [r.peak_bytes for r in tracked]
        except Exception as exc:  # a failed run is a result: report it, go on with the others
            outcome = RunOutcome(planned=run, world_size=world_size,
                                 error=f"{_last_error(exc)} (output: {log}.rank*.log)")
        else:
            for rank in range(world_size):
                Path(f"{log}.rank{rank}.log").unlink(missing_ok=True)
        outcome.wall_s = time.perf_counter() - start
        outcomes.append(outcome)
        if progress is not None:
            progress(index, outcome)
    if not any(logs.iterdir()):
        logs.rmdir()
    return outcomes
