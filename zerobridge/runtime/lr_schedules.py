"""A DeepSpeed JSON's ``scheduler`` section, built as a torch ``LRScheduler`` that sets DeepSpeed's lr at every step.

    >>> import torch
    >>> from zerobridge.runtime.lr_schedules import build_scheduler
    >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    >>> section = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
    ...                                           "warmup_max_lr": 1.0}}
    >>> scheduler = build_scheduler(section, optimizer)
    >>> lrs = [optimizer.param_groups[0]["lr"]]
    >>> for _ in range(5):
    ...     optimizer.step()
    ...     scheduler.step()
    ...     lrs.append(optimizer.param_groups[0]["lr"])
    >>> lrs
    [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]

DeepSpeed's schedules (``deepspeed.runtime.lr_schedules``) count ``last_batch_iteration`` from -1: built, they set
their value for -1 (WarmupLR, WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: 0; OneCycle: ``cycle_min_lr``, and
``cycle_min_mom`` as beta1; LRRangeTest: ``lr_range_test_min_lr``), and each ``step()`` moves to the next
iteration. So optimizer step ``k`` runs with the value at iteration ``k - 1``, and a warmup's first two steps both
get its start (``log(0 + 1) = 0``). The classes here are torch ``LRScheduler`` subclasses with
``last_epoch = last_batch_iteration + 1`` (the property ``last_batch_iteration`` reads it), whose ``get_lr``
computes DeepSpeed's formula at that iteration with DeepSpeed's operations in DeepSpeed's order: their lrs equal
DeepSpeed's to the last bit. DeepSpeed's rules they keep:

- ``warmup_num_steps`` must be a positive integer and runs as ``max(2, warmup_num_steps)``; ``warmup_type``
  defaults to ``"log"`` (``log(i + 1) / log(warmup)``), and a name other than ``"log"`` or ``"linear"`` (``i /
  warmup``) warns and warms up logarithmically.
- WarmupLR's ``warmup_max_lr`` defaults to each group's lr; WarmupDecayLR's to 0.001. WarmupDecayLR decays
  linearly to ``warmup_min_lr`` at ``total_num_steps``; WarmupCosineLR scales each group's lr by a ratio, from
  ``warmup_min_ratio`` through 1 to ``cos_min_ratio`` (default 0.0001) and stays there.
- OneCycle cycles between ``cycle_min_lr`` and ``cycle_max_lr`` over ``cycle_first_step_size`` up and
  ``cycle_second_step_size`` (default: the first) down, in stairs when a stair count is positive, then decays as
  ``cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)`` (no decay when either is 0). ``cycle_momentum``
  (default true) cycles beta1 against the lr, between ``cycle_max_mom`` and ``cycle_min_mom``, and sets beta2 to
  0.99, only for optimizers with ``betas`` (Adam's family: with SGD it warns and leaves the momentum alone).
- LRRangeTest multiplies ``lr_range_test_min_lr`` by ``1 + step_rate * (i + 1) / step_size`` (floored with
  ``lr_range_test_staircase``).
- Per-group lists (``warmup_min_lr``, ``warmup_max_lr``, ``cycle_min_lr``, ...) need one value per param group.
- ``last_batch_iteration`` other than -1 starts midway and leaves the optimizer's lr (and betas) alone until the
  first ``step()``, as DeepSpeed does.

``state_dict()`` is torch's (every attribute but the optimizer: numbers, lists, strings, no callables, loadable
with ``torch.load(weights_only=True)``) plus DeepSpeed's ``last_batch_iteration``; ``load_state_dict`` takes it,
or DeepSpeed's own ``{"last_batch_iteration": n}``. torch.optim.lr_scheduler classes DeepSpeed accepts by name
(StepLR, CosineAnnealingLR, OneCycleLR, ...) are built as DeepSpeed builds them: the class with the params as
keywords. Refused with a ``ConfigError`` naming the fix: unknown types and params (DeepSpeed fails on them),
missing required params, "auto" (only Hugging Face Trainer fills it), and torch schedulers a JSON cannot
configure (LambdaLR, MultiplicativeLR: a function; SequentialLR, ChainedScheduler: other schedulers;
ReduceLROnPlateau: a metric at every step).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zerobridge.errors import ConfigError, closest
from zerobridge.spec import is_auto

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

Value = float | torch.Tensor
"""An lr: a number, or a tensor where the param group keeps its lr in one."""
OWN_SCHEDULER = ("keep backend=\"deepspeed\" for it, or build the scheduler yourself on the optimizer and step it "
                 "after each optimizer step")
"""The fix for a scheduler a JSON cannot configure."""


# ----------------------------------------------------------------------------- checks


def _key(name: str) -> str:
    return f"scheduler.params.{name}"


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number, got {value!r}", key=_key(name), fix="write a number")
    number: float = value  # as written: an int stays an int, as in DeepSpeed's arithmetic
    return number


def _positive_int(value: Any, name: str) -> int:
    """DeepSpeed raises ValueError on anything but a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"expected a positive integer, got {value!r} (DeepSpeed raises ValueError)", key=_key(name),
                          fix="write a positive integer")
    return value


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[Value]:
    """One value per param group: a scalar for all, or a list with one each."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"expected {groups} values, one per param group, got {len(value)} (DeepSpeed raises "
                              "ValueError)", key=_key(name), fix=f"write one number, or a list of {groups}")
        return [v if isinstance(v, torch.Tensor) else _number(v, name) for v in value]
    return [_number(value, name)] * groups


def _log_warmup(warmup_type: object) -> bool:
    """DeepSpeed warms up logarithmically unless ``warmup_type`` is "linear" (it warns on unknown names)."""
    if warmup_type not in ("log", "linear"):
        warnings.warn(f"scheduler.params.warmup_type {warmup_type!r} is neither 'log' nor 'linear': warming up "
                      "logarithmically, as DeepSpeed does", UserWarning, stacklevel=3)
    return warmup_type != "linear"


def _group_lrs(optimizer: Optimizer) -> list[Value]:
    """Each group's lr as it is now (tensors copied)."""
    return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in optimizer.param_groups]


# ----------------------------------------------------------------------------- the schedules


class DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed schedule as a torch ``LRScheduler``: ``last_epoch`` is DeepSpeed's ``last_batch_iteration + 1``,
    and ``lrs_at(i)`` gives DeepSpeed's lrs at iteration ``i``."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ConfigError(f"expected an integer >= -1, got {last_batch_iteration!r}",
                              key=_key("last_batch_iteration"), fix="remove it to start from the beginning")
        held = [(g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"], g.get("betas"))
                for g in optimizer.param_groups]
        super().__init__(optimizer, last_epoch=-1)  # sets the value at iteration -1
        if last_batch_iteration != -1:  # DeepSpeed then leaves the optimizer alone until the first step
            for group, (lr, betas) in zip(optimizer.param_groups, held):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
                if betas is not None:
                    group["betas"] = betas
            self.last_epoch = last_batch_iteration + 1
            self._last_lr = _group_lrs(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's count: -1 when built, then one more per ``step()``."""
        return self.last_epoch - 1

    def lrs_at(self, iteration: int) -> list[Value]:
        """DeepSpeed's lr of each param group at ``last_batch_iteration == iteration``."""
        raise NotImplementedError

    def get_lr(self) -> list[Value]:
        return self.lrs_at(self.last_epoch - 1)

    def state_dict(self) -> dict[str, Any]:
        """torch's state (every attribute but the optimizer) and DeepSpeed's ``last_batch_iteration``."""
        return {**super().state_dict(), "last_batch_iteration": self.last_epoch - 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``, or from a DeepSpeed scheduler's ``{"last_batch_iteration": n}`` (the
        schedule's settings stay the ones built)."""
        state = dict(state_dict)
        iteration = state.pop("last_batch_iteration", None)
        if state:
            super().load_state_dict(state)
        elif iteration is not None:
            self.last_epoch = int(iteration) + 1


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over ``warmup_num_steps``, then
    constant: DeepSpeed's ``WarmupLR``."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.log_warmup = _log_warmup(warmup_type)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        peak = _group_lrs(optimizer) if warmup_max_lr is None else warmup_max_lr
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(_per_group(optimizer, peak, "warmup_max_lr"), self.min_lrs)]
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        """The fraction of the way from ``warmup_min_lr`` to ``warmup_max_lr`` at ``iteration`` (>= 0)."""
        if iteration < self.warmup_num_steps:
            if self.log_warmup:
                return self.inverse_log_warmup * math.log(iteration + 1)
            return iteration / self.warmup_num_steps
        return 1.0

    def lrs_at(self, iteration: int) -> list[Value]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linearly back to ``warmup_min_lr`` at ``total_num_steps``: DeepSpeed's ``WarmupDecayLR``
    (``warmup_max_lr`` defaults to 0.001, not to the optimizer's lr)."""

    def __init__(self, optimizer: Optimizer, total_num_steps: Any, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _number(total_num_steps, "total_num_steps")
        if self.total_num_steps < max(2, _positive_int(warmup_num_steps, "warmup_num_steps")):
            warnings.warn(f"scheduler.params.total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{warmup_num_steps}", UserWarning, stacklevel=2)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """Each group's lr times a ratio: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then a cosine
    down to ``cos_min_ratio`` at ``total_num_steps``, held there: DeepSpeed's ``WarmupCosineLR``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: Any, warmup_min_ratio: Any = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: Any = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _number(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = _number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _number(cos_min_ratio, "cos_min_ratio")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.log_warmup = _log_warmup(warmup_type)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"scheduler.params.total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{warmup_num_steps}", UserWarning, stacklevel=2)
        self.org_lrs = _group_lrs(optimizer)
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        """The factor on each group's lr at ``iteration`` (>= 0)."""
        if iteration < self.warmup_num_steps:
            if self.log_warmup:
                ratio = self.inverse_log_warmup * math.log(iteration + 1)
            else:
                ratio = iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps
                                                                          - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[Value]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """One cycle of the lr (and beta1) between two bounds, then a decay: DeepSpeed's ``OneCycle``."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: Any = 0.0,
                 cycle_first_step_size: Any = 2000, cycle_second_step_size: Any = None,
                 cycle_first_stair_count: Any = 0, cycle_second_stair_count: Any = None, decay_step_size: Any = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8, cycle_max_mom: Any = 0.9,
                 decay_mom_rate: Any = 0.0, last_batch_iteration: int = -1) -> None:
        first = float(_number(cycle_first_step_size, "cycle_first_step_size"))
        second = first if cycle_second_step_size is None else float(_number(cycle_second_step_size,
                                                                            "cycle_second_step_size"))
        if first <= 0:
            raise ConfigError(f"expected a positive number, got {cycle_first_step_size!r} (DeepSpeed raises "
                              "ValueError)", key=_key("cycle_first_step_size"), fix="write a positive number")
        if second < 0:
            raise ConfigError(f"expected a number >= 0, got {cycle_second_step_size!r} (DeepSpeed raises "
                              "ValueError)", key=_key("cycle_second_step_size"), fix="write a number >= 0")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _number(cycle_first_stair_count, "cycle_first_stair_count")
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None else \
            _number(cycle_second_stair_count, "cycle_second_stair_count")
        self.decay_step_size = _number(decay_step_size, "decay_step_size")
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = _number(decay_lr_rate, "decay_lr_rate")
        self.lr_decays = self.decay_step_size != 0 and self.decay_lr_rate != 0
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(f"OneCycle's cycle_momentum is off: {type(optimizer).__name__} has no betas (DeepSpeed "
                          "cycles beta1 only)", UserWarning, stacklevel=2)
            self.cycle_momentum = False
        self.min_moms: list[Value] = []
        self.max_moms: list[Value] = []
        self.decay_mom_rate = _number(decay_mom_rate, "decay_mom_rate")
        if self.cycle_momentum:
            self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.mom_decays = self.decay_step_size != 0 and self.decay_mom_rate != 0
        super().__init__(optimizer, last_batch_iteration)

    BETA2 = 0.99
    """The beta2 DeepSpeed's momentum cycling sets, whatever the optimizer had."""

    def scale(self, iteration: int) -> float:
        """How far up the cycle (0 at ``cycle_min_lr``, 1 at ``cycle_max_lr``) ``iteration`` is."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            position = batch % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[Value]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self.lr_decays:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def betas_at(self, iteration: int) -> list[tuple[Value, float]]:
        """DeepSpeed's betas of each param group at ``iteration`` (with ``cycle_momentum``)."""
        if iteration < 0:
            return [(mom, self.BETA2) for mom in self.min_moms]
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [(hi - (hi - lo) * scale, self.BETA2) for lo, hi in zip(self.min_moms, self.max_moms)]
        if not self.mom_decays:
            return [(mom, self.BETA2) for mom in self.max_moms]
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(mom * factor, self.BETA2) for mom in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.betas_at(self.last_epoch - 1)):
                group["betas"] = betas


class LRRangeTest(DeepSpeedSchedule):
    """``lr_range_test_min_lr`` times ``1 + step_rate * (i + 1) / step_size`` (floored in stairs): DeepSpeed's
    ``LRRangeTest``."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: Any = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: Any = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = _number(lr_range_test_step_rate, "lr_range_test_step_rate")
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[Value]:
        if iteration < 0:
            return list(self.min_lrs)
        interval: float = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]


# ----------------------------------------------------------------------------- the section

SCHEDULES: Mapping[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest}
"""DeepSpeed's schedules by type name (exact, as DeepSpeed looks them up)."""
_TORCH_REFUSED: Mapping[str, str] = {
    "LambdaLR": "takes a function, which a JSON cannot hold",
    "MultiplicativeLR": "takes a function, which a JSON cannot hold",
    "SequentialLR": "takes other schedulers, which a JSON cannot hold",
    "ChainedScheduler": "takes other schedulers, which a JSON cannot hold",
    "ReduceLROnPlateau": "steps on a metric (step(loss)), which no engine passes",
    "LRScheduler": "is the base class: it has no schedule",
}
_TORCH_SCHEDULERS: Mapping[str, type[LRScheduler]] = {
    name: value for name in dir(torch.optim.lr_scheduler)
    if isinstance(value := getattr(torch.optim.lr_scheduler, name), type) and issubclass(value, LRScheduler)
    and not name.startswith("_") and name not in _TORCH_REFUSED
}
"""torch.optim.lr_scheduler classes a JSON can configure: DeepSpeed builds them by exact name."""


def _keywords(cls: type[LRScheduler]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The keyword arguments of ``cls`` after the optimizer, and those without a default."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name not in ("self", "optimizer") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return frozenset(p.name for p in params), tuple(p.name for p in params if p.default is p.empty)


def build_scheduler(section: Mapping[str, Any], optimizer: Optimizer) -> LRScheduler:
    """The torch scheduler that sets ``optimizer``'s lr as DeepSpeed's engine does for ``section`` (a DeepSpeed
    JSON's ``scheduler``: ``{"type": ..., "params": {...}}``); step it after each optimizer step."""
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ConfigError(f"expected {{\"type\": <name>, \"params\": {{...}}}}, got {section!r}", key="scheduler",
                          fix="name the scheduler in scheduler.type")
    name = section["type"]
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"expected an object, got {params!r}", key="scheduler.params", fix="write params as {...}")
    for key, value in params.items():
        if any(is_auto(v) for v in (value if isinstance(value, (list, tuple)) else (value,))):
            raise ConfigError("\"auto\" is filled by Hugging Face Trainer only; nothing fills it when zerobridge "
                              "builds the section", key=_key(key),
                              fix="write the value (Trainer's default, or the one its flags would give)")
    if name in _TORCH_REFUSED:
        raise ConfigError(f"torch.optim.lr_scheduler.{name} {_TORCH_REFUSED[name]}", key="scheduler.type",
                          fix=OWN_SCHEDULER)
    cls: type[LRScheduler] | None = SCHEDULES.get(name) or _TORCH_SCHEDULERS.get(name)
    if cls is None:
        names = sorted({*SCHEDULES, *_TORCH_SCHEDULERS})
        near = next((n for n in names if n.lower() == name.lower()), None) or closest(name, names)
        raise ConfigError(f"DeepSpeed has no scheduler {name!r}: neither deepspeed.runtime.lr_schedules nor "
                          "torch.optim.lr_scheduler has it (names are exact)", key="scheduler.type",
                          fix=f"write {near!r}" if near else f"write one of {', '.join(names)}")
    takes, required = _keywords(cls)
    for key in params:
        if key not in takes:
            near = closest(key, takes)
            raise ConfigError(f"{name} takes no {key} (DeepSpeed raises TypeError)", key=_key(key),
                              fix="remove it" + (f" (or rename it {near!r}, if that is what it means)" if near else "")
                              + f"; {name} takes {', '.join(sorted(takes))}")
    for key in required:
        if key not in params:
            raise ConfigError(f"{name} needs {key} (DeepSpeed raises TypeError without it)", key=_key(key),
                              fix=f"set scheduler.params.{key}")
    try:
        return cls(optimizer, **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} refuses it: {exc}", key="scheduler.params", fix="fix the value it names") from exc
