"""The scheduler section of a DeepSpeed JSON as Trainer flags, report entries and torch code, and how far
Trainer's schedule departs from DeepSpeed's (``trainer_args``).

    >>> from zerobridge.translate.trainer_build import Build
    >>> from zerobridge.translate.trainer_schedule import scheduler_section
    >>> b = Build()
    >>> w = scheduler_section(b, {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_type": "linear"}})
    >>> w.kind, w.warmup, w.log, b.flags["--lr_scheduler_type"]
    ('WarmupLR', 100, False, 'constant_with_warmup')
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec.base import Auto, is_auto
from zerobridge.translate.report import Report, Status
from zerobridge.translate.trainer_build import (
    ILLUSTRATIVE_WARMUP,
    NOT_FILLED,
    OWN_SCHEDULER,
    Build,
    as_number,
    call,
    fraction,
    lit,
    step_count,
)

__all__ = ["DECAY_DEFAULT_PEAK", "TORCH_SCHEDULERS", "WARMUP_PARAMS", "OtherScheduler", "Warmup", "gap_note",
           "scheduler_code", "scheduler_section", "type_entry"]

WARMUP_PARAMS: Mapping[str, frozenset[str]] = {
    "WarmupLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                           "last_batch_iteration"}),
    "WarmupDecayLR": frozenset({"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                "warmup_type", "last_batch_iteration"}),
    "WarmupCosineLR": frozenset({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                 "warmup_type", "last_batch_iteration"}),
}
"""The keyword arguments of DeepSpeed's warmup schedulers (``deepspeed.runtime.lr_schedules``)."""
_TRAINER_TYPE = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine_with_min_lr"}
_DEEPSPEED_OTHERS = {
    "OneCycle": "cycles the lr between cycle_min_lr and cycle_max_lr (and, by default, the momentum or beta1 "
                "against it) and then decays it in steps: no --lr_scheduler_type has that shape",
    "LRRangeTest": "raises the lr without bound to find the largest stable one: a probe, not a training schedule, "
                   "and no --lr_scheduler_type has it",
}
TORCH_SCHEDULERS = frozenset({"LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                               "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler",
                               "ReduceLROnPlateau", "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
                               "PolynomialLR"})
"""torch.optim.lr_scheduler classes, which DeepSpeed builds by name when lr_schedules has none."""
DECAY_DEFAULT_PEAK = 0.001
"""WarmupDecayLR's warmup_max_lr default: unlike WarmupLR (None: the optimizer's lr), a fixed 0.001."""


@dataclass(frozen=True)
class Warmup:
    """One of DeepSpeed's warmup schedules, as resolved."""

    kind: str
    warmup: int | Auto
    """warmup_num_steps as written; DeepSpeed runs ``max(2, it)``."""
    total: int | Auto | None
    """total_num_steps; None for WarmupLR."""
    log: bool
    start: float
    """warmup_min_lr (WarmupLR, WarmupDecayLR; "auto": Trainer fills 0) or warmup_min_ratio (WarmupCosineLR)."""
    cos_min: float
    peak: float | Auto | None
    """WarmupLR / WarmupDecayLR: the lr it peaks at, when the scheduler (not the optimizer) sets it; else None."""


@dataclass(frozen=True)
class OtherScheduler:
    """A scheduler Trainer has no form for: DeepSpeed's own class, a torch one, or one DeepSpeed refuses."""

    name: str
    params: Mapping[str, Any]
    where: str
    """``deepspeed``, ``torch`` or ``unknown``."""


def scheduler_section(b: Build, section: Any) -> Warmup | OtherScheduler | None:
    if section is None:
        b.report.add("scheduler", Status.EQUIVALENT,
                     "no scheduler section: DeepSpeed alone keeps the lr constant, but Trainer builds its own "
                     "scheduler (--lr_scheduler_type, default linear decay to 0) with or without the JSON; pass "
                     "--lr_scheduler_type constant to keep it constant. `code` keeps it constant")
        return None
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ConfigError(f"expected {{\"type\": <name>, \"params\": {{...}}}}, got {section!r}", key="scheduler",
                          fix="name the scheduler in scheduler.type")
    name, params = section["type"], section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"expected an object, got {params!r}", key="scheduler.params", fix="write params as {...}")
    for key in section:
        if key not in ("type", "params"):
            b.report.add(f"scheduler.{key}", Status.IGNORED, "DeepSpeed reads only type and params here")
    if name in WARMUP_PARAMS:
        return _warmup(b, name, params)
    if name in _DEEPSPEED_OTHERS or name in TORCH_SCHEDULERS:
        where = "deepspeed" if name in _DEEPSPEED_OTHERS else "torch"
        why = _DEEPSPEED_OTHERS.get(name) or f"Trainer has no --lr_scheduler_type for torch.optim.lr_scheduler.{name}"
        b.report.add("scheduler.type", Status.NOT_EXPRESSIBLE, f"{why}; Trainer alone would use its linear decay: "
                     f"{OWN_SCHEDULER}")
        for key in params:
            b.report.add(f"scheduler.params.{key}", Status.NOT_EXPRESSIBLE,
                         NOT_FILLED if is_auto(params[key]) else f"part of {name}: `code` passes it")
        return OtherScheduler(name, params, where)
    b.report.add("scheduler.type", Status.NOT_EXPRESSIBLE, f"DeepSpeed refuses {name!r}: neither "
                 "deepspeed.runtime.lr_schedules nor torch.optim.lr_scheduler has it (names are exact); fix "
                 "scheduler.type")
    for key in params:
        b.report.add(f"scheduler.params.{key}", Status.NOT_EXPRESSIBLE, f"part of {name}, which DeepSpeed refuses")
    return OtherScheduler(name, params, "unknown")


def _warmup(b: Build, kind: str, params: Mapping[str, Any]) -> Warmup:
    report, p = b.report, "scheduler.params."
    type_entry(report, "")
    for key in params:
        if key not in WARMUP_PARAMS[kind]:
            report.add(p + key, Status.NOT_EXPRESSIBLE, f"{kind} takes no {key}: DeepSpeed fails on it (TypeError); "
                       "remove it")
    warmup = step_count(params.get("warmup_num_steps"), p + "warmup_num_steps")
    if warmup is None:
        warmup = 1000
        report.add(p + "warmup_num_steps", Status.DEFAULT, f"absent: {kind} warms up over 1000 steps",
                   target="--warmup_steps")
    elif is_auto(warmup):
        report.add(p + "warmup_num_steps", Status.EQUIVALENT, "Trainer fills max(1, --warmup_steps); DeepSpeed "
                   "warms up over at least 2 steps, so below 2 Trainer alone differs (no warmup by default)",
                   target="--warmup_steps")
    elif warmup < 2:
        report.add(p + "warmup_num_steps", Status.APPROXIMATED, "DeepSpeed warms up over max(2, warmup_num_steps) "
                   "= 2 steps, Trainer over 1", target="--warmup_steps")
    else:
        report.add(p + "warmup_num_steps", Status.EXACT, "the same length (the lag is on scheduler.type)",
                   target="--warmup_steps")
    if not is_auto(warmup):
        b.flags["--warmup_steps"] = str(warmup)
    total: int | Auto | None = None
    if kind != "WarmupLR":
        total = step_count(params.get("total_num_steps"), p + "total_num_steps")
        if total is None:
            raise ConfigError(f"{kind} needs total_num_steps (DeepSpeed raises TypeError without it)",
                              key=p + "total_num_steps", fix="set it to the run's optimizer steps, or \"auto\"")
        if is_auto(total):
            report.add(p + "total_num_steps", Status.EQUIVALENT, "Trainer fills the run's optimizer steps",
                       target="--max_steps")
        else:
            b.flags["--max_steps"] = str(total)
            report.add(p + "total_num_steps", Status.EXACT, "Trainer's schedule ends there, and so does its run",
                       target="--max_steps")
    log = _warmup_type(report, kind, params)
    last = params.get("last_batch_iteration", -1)
    if "last_batch_iteration" in params:
        report.add(p + "last_batch_iteration", Status.EXACT if last == -1 else Status.NOT_EXPRESSIBLE,
                   "starts from the beginning, as Trainer's" if last == -1 else "resumes DeepSpeed's schedule "
                   "midway; Trainer resumes from its own checkpoint: remove it")
    if kind == "WarmupCosineLR":
        return _cosine(b, params, warmup, total, log)
    given = as_number(params.get("warmup_min_lr"), p + "warmup_min_lr")
    start = given if isinstance(given, float) else 0.0
    if is_auto(given):
        report.add(p + "warmup_min_lr", Status.EQUIVALENT, "Trainer fills 0 (it has no flag for it)")
    elif given == 0:
        report.add(p + "warmup_min_lr", Status.EXACT, "Trainer warms up from 0")
    elif given is not None:
        report.add(p + "warmup_min_lr", Status.APPROXIMATED, "Trainer warms up from 0" + (
            "" if kind == "WarmupLR" else " and decays to 0, where DeepSpeed decays to warmup_min_lr"))
    peak = as_number(params.get("warmup_max_lr"), p + "warmup_max_lr")
    if peak is None and kind == "WarmupDecayLR":
        peak = DECAY_DEFAULT_PEAK
        report.add(p + "warmup_max_lr", Status.DEFAULT, "absent: WarmupDecayLR peaks at its default 0.001, not at "
                   "the optimizer's lr", target="--learning_rate")
    elif is_auto(peak):
        report.add(p + "warmup_max_lr", Status.EQUIVALENT, "Trainer fills it from --learning_rate",
                   target="--learning_rate")
    elif peak is not None:
        report.add(p + "warmup_max_lr", Status.EXACT, "Trainer's schedule peaks at --learning_rate",
                   target="--learning_rate")
    b.flags["--lr_scheduler_type"] = _TRAINER_TYPE[kind]
    return Warmup(kind, warmup, total, log, start, 0.0, None if is_auto(peak) else peak)


def type_entry(report: Report, note: str) -> None:
    """scheduler.type of a warmup schedule (added first, with its note once the lr is known)."""
    report.add("scheduler.type", Status.APPROXIMATED, note, target="--lr_scheduler_type")


def _warmup_type(report: Report, kind: str, params: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed warms up logarithmically (its default, and its fallback for unknown names)."""
    key = "scheduler.params.warmup_type"
    value = params.get("warmup_type")
    if value == "linear":
        report.add(key, Status.EXACT, "Trainer warms up linearly too (the lag is on scheduler.type)",
                   target="--lr_scheduler_type")
        return False
    if value is None:
        report.add(key, Status.APPROXIMATED, f"absent: {kind} warms up logarithmically (log is DeepSpeed's "
                   "default), Trainer linearly; the gap is on scheduler.type", target="--lr_scheduler_type")
    elif value == "log":
        report.add(key, Status.APPROXIMATED, "Trainer warms up linearly; the gap is on scheduler.type",
                   target="--lr_scheduler_type")
    else:
        report.add(key, Status.IGNORED, f"DeepSpeed warns on {value!r} and warms up logarithmically; Trainer "
                   "linearly (the gap is on scheduler.type): write \"log\" or \"linear\"",
                   target="--lr_scheduler_type")
    return True


def _cosine(b: Build, params: Mapping[str, Any], warmup: int | Auto, total: int | Auto | None,
            log: bool) -> Warmup:
    report, p = b.report, "scheduler.params."
    start = as_number(params.get("warmup_min_ratio"), p + "warmup_min_ratio")
    if is_auto(start):
        report.add(p + "warmup_min_ratio", Status.NOT_EXPRESSIBLE, f"{NOT_FILLED}; `code` uses the default 0.0")
        start = 0.0
    elif start is not None:
        report.add(p + "warmup_min_ratio", Status.EXACT if start == 0 else Status.APPROXIMATED,
                   "Trainer warms up from 0" + ("" if start == 0 else ", DeepSpeed from warmup_min_ratio x lr"))
    cos_min = as_number(params.get("cos_min_ratio"), p + "cos_min_ratio")
    if cos_min is None or is_auto(cos_min):
        note = "absent: WarmupCosineLR decays to its default 0.0001 x lr" if cos_min is None else \
            f"{NOT_FILLED}; the default 0.0001 is written"
        report.add(p + "cos_min_ratio", Status.DEFAULT if cos_min is None else Status.NOT_EXPRESSIBLE, note,
                   target="--lr_scheduler_kwargs min_lr_rate")
        cos_min = 0.0001
    else:
        report.add(p + "cos_min_ratio", Status.EXACT, "the ratio of the lr the decay ends at",
                   target="--lr_scheduler_kwargs min_lr_rate" if cos_min else "--lr_scheduler_type cosine")
    if cos_min:
        b.flags["--lr_scheduler_type"] = "cosine_with_min_lr"
        b.flags["--lr_scheduler_kwargs"] = json.dumps({"min_lr_rate": cos_min})
    else:
        b.flags["--lr_scheduler_type"] = "cosine"
    return Warmup("WarmupCosineLR", warmup, total, log, start or 0.0, cos_min, None)



@dataclass(frozen=True)
class _Shape:
    """A warmup schedule as fractions of its peak, in DeepSpeed's and in Trainer's hands."""

    kind: str
    warmup: int
    """Trainer's warmup steps; DeepSpeed runs max(2, warmup)."""
    total: int | None
    log: bool
    start: float
    cos_min: float

    def deepspeed(self, k: int) -> float:
        """DeepSpeed's lr for optimizer step ``k``: its value at last_batch_iteration ``k - 1``."""
        i, w = k - 1, max(2, self.warmup)
        if i < 0:
            return 0.0 if self.kind == "WarmupCosineLR" else self.start
        if i < w:
            gamma = 1.0 / math.log(w) * math.log(i + 1) if self.log else i / w
            return self.start + (1.0 - self.start) * gamma
        total = self.total if self.total is not None else 10**9
        if self.kind == "WarmupLR":
            return 1.0
        if self.kind == "WarmupDecayLR":
            return self.start + (1.0 - self.start) * max(0.0, (total - i) / max(1.0, total - w))
        ratio = (1 + math.cos(math.pi * min(1.0, (i - w + 1) / max(1, total - w)))) / 2
        return max(0.0, self.cos_min + (1.0 - self.cos_min) * ratio)

    def trainer(self, k: int) -> float:
        """Trainer's lr for optimizer step ``k``: its LambdaLR's factor at ``k``."""
        n = self.warmup
        if k < n:
            return k / max(1, n)
        total = self.total if self.total is not None else 10**9
        if self.kind == "WarmupLR":
            return 1.0
        if self.kind == "WarmupDecayLR":
            return max(0.0, (total - k) / max(1, total - n))
        factor = 0.5 * (1.0 + math.cos(math.pi * (k - n) / max(1, total - n)))
        return max(0.0, factor * (1 - self.cos_min) + self.cos_min)

    def gap(self) -> tuple[float, int]:
        """The largest difference, as a fraction of the peak, over the run (or the warmup when its length is
        unknown), and the first step it is reached at."""
        steps = self.total if self.total is not None else max(2, self.warmup) + 2
        gaps = [abs(self.deepspeed(k) - self.trainer(k)) for k in range(steps)]
        largest = max(gaps)
        return largest, next(k for k, g in enumerate(gaps) if g >= largest * (1 - 1e-9))


def gap_note(w: Warmup, peak: float | Auto | None) -> str:
    """The scheduler.type note: where Trainer's schedule departs from DeepSpeed's, and by how much."""
    first = ("DeepSpeed gives optimizer step 0 lr 0 and step 1 warmup_min_ratio x lr" if w.kind == "WarmupCosineLR"
             else "DeepSpeed gives optimizer steps 0 and 1 warmup_min_lr")
    parts = [f"one-step lag: {first}, then each warmup value one step after Trainer"]
    start: float | None = w.start
    if w.kind != "WarmupCosineLR" and start:
        start = start / peak if isinstance(peak, float) and peak else None
    warmup = ILLUSTRATIVE_WARMUP if is_auto(w.warmup) else w.warmup
    total = w.total if isinstance(w.total, int) else None
    if start is None:
        parts.append("the size of the gap depends on --learning_rate (warmup_min_lr is absolute)")
    else:
        gap, step = _Shape(w.kind, warmup, total, w.log, start, w.cos_min).gap()
        size = f" ({fraction(gap * peak)})" if isinstance(peak, float) else ""
        where = f"with {warmup} warmup steps (warmup_num_steps is \"auto\"), " if is_auto(w.warmup) else ""
        span = "over the run" if total is not None or w.kind == "WarmupLR" else "over the warmup"
        parts.append(f"{where}Trainer's lr differs {span} by at most {fraction(gap)} of the peak lr{size}, first "
                     f"at step {step}" + (" (log warmup against Trainer's linear one)" if w.log else ""))
    if w.kind == "WarmupDecayLR":
        parts.append("the linear decay lags one step too, (1 - warmup_min_lr / peak) / (total_num_steps - "
                     "warmup_num_steps) of the peak lr" + ("" if not w.start else ", and ends at warmup_min_lr where "
                                                         "Trainer ends at 0"))
    if w.kind == "WarmupCosineLR":
        parts.append("from step warmup_num_steps + 1 on, the cosine decay is exactly Trainer's")
    parts.append("`code` reproduces DeepSpeed's schedule exactly")
    return "; ".join(parts)


def scheduler_code(b: Build, sched: Warmup | OtherScheduler | None, lr: str) -> tuple[list[str], list[str], bool]:
    """The scheduler's imports and lines, and whether they use ``total_steps``."""
    if sched is None:
        return [], ["# No scheduler section: DeepSpeed keeps the lr constant.",
                    "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)"], False
    if isinstance(sched, OtherScheduler):
        if sched.where == "unknown":
            return [], [f"raise NotImplementedError({f'DeepSpeed has no scheduler {sched.name!r}'!r})"], False
        args = ["optimizer", *(f"{k}={lit(v)}" for k, v in sched.params.items() if not is_auto(v))]
        if sched.where == "deepspeed":
            return ([f"from deepspeed.runtime.lr_schedules import {sched.name}  # no torch form: DeepSpeed's own"],
                    call("scheduler", sched.name, args), False)
        return [], call("scheduler", f"torch.optim.lr_scheduler.{sched.name}", args), False
    warmup = b.auto_var("warmup_num_steps") if is_auto(sched.warmup) else str(sched.warmup)
    total = "total_steps" if is_auto(sched.total) else str(sched.total)
    growth = "1.0 / math.log(WARMUP) * math.log(i + 1)" if sched.log else "i / WARMUP"
    lines = [f"# DeepSpeed's {sched.kind}, {'log' if sched.log else 'linear'} warmup, one step behind as DeepSpeed "
             "runs it: optimizer", "# step k gets its value at last_batch_iteration k - 1 (-1 when it is built)."]
    if sched.kind == "WarmupCosineLR":
        lines += [f"WARMUP_MIN_RATIO, COS_MIN_RATIO = {lit(sched.start)}, {lit(sched.cos_min)}",
                  f"WARMUP, TOTAL = max(2, {warmup}), {total}  # DeepSpeed warms up over at least 2 steps", "", "",
                  "def lr_ratio(step: int) -> float:", "    i = step - 1", "    if i < 0:", "        return 0.0",
                  "    if i < WARMUP:", f"        ratio = {growth}",
                  "        return WARMUP_MIN_RATIO + ratio * (1.0 - WARMUP_MIN_RATIO)",
                  "    progress = min(1.0, (i - WARMUP + 1) / max(1, TOTAL - WARMUP))",
                  "    ratio = (1 + math.cos(math.pi * progress)) / 2",
                  "    return max(0.0, COS_MIN_RATIO + (1.0 - COS_MIN_RATIO) * ratio)", "", "",
                  "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_ratio)"]
        return [], lines, is_auto(sched.total)
    peak = lr or 'optimizer.param_groups[0]["lr"]'
    lines += [f"MIN_LR, MAX_LR = {lit(sched.start)}, {peak}",
              f"WARMUP = max(2, {warmup})  # DeepSpeed warms up over at least 2 steps"]
    gamma = [f"    gamma = {growth} if i < WARMUP else 1.0"]
    if sched.kind == "WarmupDecayLR":
        lines.append(f"TOTAL = {total}")
        gamma = ["    if i < WARMUP:", f"        gamma = {growth}", "    else:",
                 "        gamma = max(0.0, float(TOTAL - i) / float(max(1.0, TOTAL - WARMUP)))"]
    lines += ["", "", "def lr_at(step: int) -> float:", "    i = step - 1", "    if i < 0:", "        return MIN_LR",
              *gamma, "    return MIN_LR + (MAX_LR - MIN_LR) * gamma", "", "",
              "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / MAX_LR)"]
    return [], lines, is_auto(sched.total)
