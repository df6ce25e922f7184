"""What the Trainer translation (``trainer_args``) builds on: the form it returns, the builder its sections fill,
and how values are read from the JSON and written as flags and code.

    >>> from zerobridge.translate.trainer_build import Build, as_number, lit
    >>> lit(0.0003), lit([0.9, 0.95]), as_number("auto", "optimizer.params.lr")
    ('0.0003', '(0.9, 0.95)', 'auto')
    >>> b = Build()
    >>> b.flags["--learning_rate"] = "0.0003"
    >>> b.trainer_form("").flags
    ('--learning_rate', '0.0003')
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec.base import AUTO, Auto, is_auto
from zerobridge.translate.report import Report

__all__ = ["AUTO_VARS", "FILLED", "ILLUSTRATIVE_WARMUP", "NOT_FILLED", "OWN_OPTIMIZER", "OWN_SCHEDULER",
           "TRAINER_DEFAULTS", "Build", "TrainerForm", "as_number", "call", "fraction", "lit", "step_count"]

TRAINER_DEFAULTS: Mapping[str, float] = {"learning_rate": 5e-05, "adam_beta1": 0.9, "adam_beta2": 0.999,
                                         "adam_epsilon": 1e-08, "weight_decay": 0.0, "warmup_num_steps": 1}
"""What Trainer fills each "auto" with when no flag is given, by the name ``code`` gives the value
(``warmup_num_steps`` is ``max(1, --warmup_steps)``, and --warmup_steps defaults to 0)."""
_FILLED_FROM = {"warmup_num_steps": "max(1, --warmup_steps)"}

_FLAG_ORDER = ("--optim", "--optim_args", "--learning_rate", "--adam_beta1", "--adam_beta2", "--adam_epsilon",
               "--weight_decay", "--lr_scheduler_type", "--lr_scheduler_kwargs", "--warmup_steps", "--max_steps")
FILLED = {"lr": "--learning_rate", "betas": "--adam_beta1/--adam_beta2", "eps": "--adam_epsilon",
           "weight_decay": "--weight_decay"}
"""Optimizer params Trainer fills from (or checks against) its flags when the JSON keeps the section."""
AUTO_VARS = {"lr": "learning_rate", "betas": "(adam_beta1, adam_beta2)", "eps": "adam_epsilon",
              "weight_decay": "weight_decay"}
OWN_OPTIMIZER = "pass Trainer(optimizers=(optimizer, None)) with the optimizer from `code`, or keep DeepSpeed"
OWN_SCHEDULER = "pass Trainer(optimizers=(optimizer, scheduler)) with both from `code`, or keep DeepSpeed"
NOT_FILLED = "Trainer fills no such key: DeepSpeed would get the string 'auto' and fail; set a value"
ILLUSTRATIVE_WARMUP = 100
"""Warmup length the notes size a gap at when warmup_num_steps is "auto"."""


@dataclass(frozen=True)
class TrainerForm:
    """How Hugging Face Trainer, or a plain torch loop, rebuilds a DeepSpeed optimizer and scheduler."""

    flags: tuple[str, ...]
    """``TrainingArguments`` command-line pieces (``("--optim", "adamw_torch", ...)``)."""
    report: Report
    """One entry per key of the optimizer and scheduler sections (dotted, as in the JSON), plus DEFAULT (or, where
    the default changes the run, APPROXIMATED) entries for absent keys whose DeepSpeed default became a flag."""
    code: str
    """Torch code that builds ``optimizer`` and ``scheduler`` as DeepSpeed does, for a loop that calls
    ``scheduler.step()`` after each ``optimizer.step()``; it assumes ``model`` (and, where it says so,
    ``total_steps``) exist."""

    @property
    def command_line(self) -> str:
        """The flags quoted for a shell."""
        return shlex.join(self.flags)




def lit(value: Any) -> str:
    """A Python literal for ``code`` and flags (floats round-trip exactly)."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(lit(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{lit(k)}: {lit(v)}" for k, v in value.items()) + "}"
    return repr(value)


def as_number(value: Any, key: str) -> float | Auto | None:
    """A concrete number, "auto", or None when absent; anything else is the config's error."""
    if value is None:
        return None
    if is_auto(value):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number or \"auto\", got {value!r}", key=key,
                          fix="write one number (per-group lists have no TrainingArguments form)")
    return float(value)


def step_count(value: Any, key: str) -> int | Auto | None:
    """A positive step count: DeepSpeed raises on anything but a positive int."""
    if value is None:
        return None
    if is_auto(value):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"expected a positive integer or \"auto\", got {value!r} (DeepSpeed refuses it)", key=key,
                          fix="write a positive integer, or \"auto\" for Trainer to fill")
    return value


def fraction(value: float) -> str:
    return f"{value:.3g}"


def call(name: str, ctor: str, args: list[str]) -> list[str]:
    """``name = ctor(args)``, its arguments wrapped to 120 columns."""
    line = f"{name} = {ctor}({', '.join(args)})"
    if len(line) <= 120:
        return [line]
    rows = [""]
    for arg in args:
        if rows[-1] and len(rows[-1]) + len(arg) + 6 > 120:
            rows.append("")
        rows[-1] += f"{arg}, "
    return [f"{name} = {ctor}(", *(f"    {row.rstrip()}" for row in rows), ")"]



@dataclass
class Build:
    """Flags, report and code, filled section by section."""

    flags: dict[str, str] = field(default_factory=dict)
    optim_args: dict[str, str] = field(default_factory=dict)
    report: Report = field(default_factory=lambda: Report(source="deepspeed", target="TrainingArguments"))
    settings: dict[str, str] = field(default_factory=dict)
    """``code`` variables standing for "auto": name -> the line that sets it."""
    left_out: list[str] = field(default_factory=list)
    """Optimizer params its class does not take (DeepSpeed would fail on them): ``code`` leaves them out."""

    def auto_var(self, expression: str) -> str:
        """Declare the ``code`` variables an "auto" expression (``(adam_beta1, adam_beta2)``) uses."""
        for name in expression.strip("()").split(", "):
            if name not in self.settings:
                source = _FILLED_FROM.get(name, f"--{name}")
                self.settings[name] = (f"{name} = {lit(TRAINER_DEFAULTS[name])}  # \"auto\": Trainer fills "
                                       f"{source}; its default here")
        return expression

    def trainer_form(self, code: str) -> TrainerForm:
        flags = dict(self.flags)
        if self.optim_args:
            flags["--optim_args"] = ",".join(f"{k}={v}" for k, v in self.optim_args.items())
        return TrainerForm(tuple(piece for key in _FLAG_ORDER if key in flags for piece in (key, flags[key])),
                           self.report, code)
