"""A DeepSpeed JSON's optimizer and scheduler -> Hugging Face ``TrainingArguments`` flags and plain torch code.

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.translate.trainer_args import trainer_form_of
    >>> ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
    ...       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_type": "linear"}}}
    >>> form = trainer_form_of(StrategySpec(passthrough={"deepspeed": ds}))
    >>> form.flags[:6]
    ('--optim', 'adamw_torch', '--learning_rate', '0.0003', '--adam_beta1', '0.9')
    >>> form.flags[-4:]
    ('--lr_scheduler_type', 'constant_with_warmup', '--warmup_steps', '100')
    >>> entry = form.report.find("scheduler.type")
    >>> entry.status.value, entry.note.split(",")[0]
    ('approximated', 'one-step lag: DeepSpeed gives optimizer steps 0 and 1 warmup_min_lr')
    >>> "torch.optim.AdamW(model.parameters(), lr=0.0003, betas=(0.9, 0.95)" in form.code
    True

A DeepSpeed JSON keeps ``optimizer`` and ``scheduler`` verbatim in ``spec.passthrough["deepspeed"]``. Targets
that cannot carry them (Accelerate's FSDP YAML, FSDP keyword arguments, Lightning) leave them to the training
script: ``trainer_form_of`` gives the ``TrainingArguments`` flags that rebuild them in Hugging Face ``Trainer``,
and ``code`` for a plain torch loop. The flags hold in both flavors of Trainer: alone (the sections dropped), and
with the DeepSpeed JSON kept, where ``HfTrainerDeepSpeedConfig`` fills every "auto" from them and refuses concrete
values that disagree with them (``optimizer.params.lr/betas/eps/weight_decay``,
``scheduler.params.warmup_max_lr/warmup_num_steps/total_num_steps``; ``warmup_min_lr`` "auto" becomes 0).

=================================  ==================================================  ==============================
DeepSpeed JSON                     TrainingArguments                                   status
=================================  ==================================================  ==============================
optimizer Adam, AdamW              ``--optim adamw_torch`` (always written: Trainer's  EXACT with ``torch_adam`` (it
(``adam_w_mode`` defaults true;    default is ``adamw_torch_fused``)                   builds torch.optim.AdamW),
type AdamW forces it)                                                                  else EQUIVALENT (FusedAdam /
                                                                                       DeepSpeedCPUAdam: same update)
Adam with ``adam_w_mode: false``   ``--optim adamw_torch``                             EQUIVALENT at weight_decay 0,
                                                                                       else APPROXIMATED (L2 decay)
params.lr / betas / eps            ``--learning_rate`` / ``--adam_beta1 --adam_beta2``  EXACT; "auto": EQUIVALENT
                                   / ``--adam_epsilon``
params.weight_decay                ``--weight_decay``                                  EXACT at 0, else APPROXIMATED:
                                                                                       Trainer exempts biases and
                                                                                       norm weights, DeepSpeed not
absent lr, betas, eps, wd          DeepSpeed's default, written (wd 0.0; 0.01 when     DEFAULT
                                   torch_adam builds torch.optim.AdamW)
SGD / Adagrad / RMSprop            ``--optim sgd|adagrad|rmsprop``, ``--optim_args``   EXACT (the same torch class)
Lamb, Lion, MuAdam(W), MuSGD,      none (Trainer would build its own AdamW)            NOT_EXPRESSIBLE: pass
Muon, OneBitAdam, ZeroOneAdam,                                                         ``optimizers=(optimizer,
OneBitLamb, other torch.optim                                                          None)`` from ``code``
scheduler WarmupLR                 ``constant_with_warmup --warmup_steps N``           APPROXIMATED: one-step lag
WarmupDecayLR                      ``linear --warmup_steps N --max_steps T``           APPROXIMATED: lag in warmup
                                                                                       and decay; ends at
                                                                                       warmup_min_lr, Trainer at 0
WarmupCosineLR                     ``cosine_with_min_lr`` + ``--lr_scheduler_kwargs    APPROXIMATED in the warmup;
                                   {"min_lr_rate": cos_min_ratio}`` (``cosine`` at 0)  the cosine decay is exact
warmup_type "log" (the default)    none: Trainer warms up linearly                     APPROXIMATED
warmup_min_lr, warmup_min_ratio    none: Trainer warms up from 0                       APPROXIMATED when not 0
OneCycle, LRRangeTest,             none (Trainer would use its linear decay)           NOT_EXPRESSIBLE: pass the
torch.optim.lr_scheduler.*                                                             scheduler from ``code``
no optimizer / scheduler section   none: Trainer builds its own, with or without the   EQUIVALENT (DeepSpeed alone
                                   JSON                                                keeps the lr constant)
"auto" (keys Trainer fills)        none: Trainer fills it from its own flags           EQUIVALENT
=================================  ==================================================  ==============================

Step semantics. DeepSpeed's engine and Trainer both step the scheduler once after each optimizer step. A DeepSpeed
warmup scheduler sets, when built, its value for ``last_batch_iteration = -1`` (warmup_min_lr; 0 for
WarmupCosineLR), and iteration 0 repeats the start: optimizer step ``k`` runs with DeepSpeed's value at ``k - 1``,
while Trainer's ``LambdaLR`` gives step ``k`` its value at ``k``. DeepSpeed's warmup so runs one step behind, and it
clamps ``warmup_num_steps`` to at least 2. The gaps (each note gives its config's): a linear warmup over N steps
lags one increment, 1/N of the peak lr; DeepSpeed's default log warmup runs up to 0.45 of the peak above Trainer's
linear one at N = 100 (0.20 at 10, 0.58 at 1000); WarmupDecayLR's decay lags ``(1 - start) / (T - N)`` of the
peak; WarmupCosineLR's decay equals Trainer's ``cosine_with_min_lr`` exactly. ``code`` computes DeepSpeed's own
schedule, lag and log warmup included (a ``LambdaLR`` over DeepSpeed's formula), so the plain-loop form is exact.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.spec.base import AUTO, Auto, is_auto
from zerobridge.translate.report import Report, Status

__all__ = ["TRAINER_DEFAULTS", "TrainerForm", "trainer_form_of"]

TRAINER_DEFAULTS: Mapping[str, float] = {"learning_rate": 5e-05, "adam_beta1": 0.9, "adam_beta2": 0.999,
                                         "adam_epsilon": 1e-08, "weight_decay": 0.0, "warmup_num_steps": 1}
"""What Trainer fills each "auto" with when no flag is given, by the name ``code`` gives the value
(``warmup_num_steps`` is ``max(1, --warmup_steps)``, and --warmup_steps defaults to 0)."""
_FILLED_FROM = {"warmup_num_steps": "max(1, --warmup_steps)"}

_FLAG_ORDER = ("--optim", "--optim_args", "--learning_rate", "--adam_beta1", "--adam_beta2", "--adam_epsilon",
               "--weight_decay", "--lr_scheduler_type", "--lr_scheduler_kwargs", "--warmup_steps", "--max_steps")
_FILLED = {"lr": "--learning_rate", "betas": "--adam_beta1/--adam_beta2", "eps": "--adam_epsilon",
           "weight_decay": "--weight_decay"}
"""Optimizer params Trainer fills from (or checks against) its flags when the JSON keeps the section."""
_AUTO_VARS = {"lr": "learning_rate", "betas": "(adam_beta1, adam_beta2)", "eps": "adam_epsilon",
              "weight_decay": "weight_decay"}
_OWN_OPTIMIZER = "pass Trainer(optimizers=(optimizer, None)) with the optimizer from `code`, or keep DeepSpeed"
_OWN_SCHEDULER = "pass Trainer(optimizers=(optimizer, scheduler)) with both from `code`, or keep DeepSpeed"
_NOT_FILLED = "Trainer fills no such key: DeepSpeed would get the string 'auto' and fail; set a value"
_ILLUSTRATIVE_WARMUP = 100
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


# ----------------------------------------------------------------------------- optimizer families


@dataclass(frozen=True)
class _Family:
    """What DeepSpeed builds for one optimizer type, and what Trainer builds for it."""

    builds: str
    """The class DeepSpeed instantiates, for notes."""
    ctor: str | None
    """The constructor ``code`` calls; None when nothing outside DeepSpeed's engine builds it."""
    optim: str | None
    """Trainer's ``--optim``; None when Trainer has none."""
    defaults: Mapping[str, Any]
    """Keyword defaults of ``builds`` that the flags state when the JSON leaves them out."""
    status: Status
    note: str
    optim_args: frozenset[str] = frozenset()
    """Params Trainer passes through ``--optim_args`` for this ``--optim``."""
    mechanics: frozenset[str] = frozenset()
    """Params that change how the update is computed, not what it is."""
    consumed: frozenset[str] = frozenset()
    """Params DeepSpeed reads itself or passes to its own class only (``code`` leaves them out)."""
    imports: tuple[str, ...] = ()
    adam: bool = False


_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
"""FusedAdam's, DeepSpeedCPUAdam's and torch's Adam/AdamW defaults (weight_decay differs: set per class)."""
_TORCH_FAMILIES: Mapping[str, tuple[str, Mapping[str, Any], frozenset[str], frozenset[str]]] = {
    "SGD": ("sgd", {"lr": 1e-3, "weight_decay": 0.0}, frozenset({"momentum", "dampening", "nesterov"}),
            frozenset({"foreach", "differentiable", "fused"})),
    "Adagrad": ("adagrad", {"lr": 1e-2, "weight_decay": 0.0}, frozenset({"lr_decay", "eps"}),
                frozenset({"foreach", "differentiable", "fused", "fp32_optimizer_states"})),
    "RMSprop": ("rmsprop", {"lr": 1e-2, "weight_decay": 0.0}, frozenset({"alpha", "eps", "momentum", "centered"}),
                frozenset({"capturable", "foreach", "differentiable"})),
}
"""torch.optim classes Trainer has an ``--optim`` for: (optim, defaults the flags state, ``--optim_args`` keys,
mechanics). DeepSpeed passes the JSON's params to the same class, so the defaults are torch's."""
_TORCH_OPTIMIZERS = frozenset({"ASGD", "Adadelta", "Adafactor", "Adamax", "LBFGS", "NAdam", "RAdam", "Rprop",
                               "SparseAdam"})
"""Other torch.optim classes: DeepSpeed builds them by exact name (``getattr(torch.optim, type)``)."""
_ONE_BIT = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


def _family(name: str, params: Mapping[str, Any], offloaded: bool) -> _Family:
    """How DeepSpeed's engine (``_configure_basic_optimizer``) reads ``type``: its own optimizers case-insensitively
    (adagrad, adam, adamw, lamb, lion, muadam, muadamw, musgd, muon), any other by its exact torch.optim name."""
    lower = name.lower()
    if lower in ("adam", "adamw"):
        return _adam_family(lower, params, offloaded)
    if lower == "adagrad" or name in _TORCH_FAMILIES:
        torch_name = "Adagrad" if lower == "adagrad" else name
        optim, defaults, optim_args, mechanics = _TORCH_FAMILIES[torch_name]
        builds = "DeepSpeedCPUAdagrad" if offloaded and lower == "adagrad" else f"torch.optim.{torch_name}"
        note = f"DeepSpeed builds {builds}; --optim {optim} builds torch.optim.{torch_name}"
        if builds != f"torch.optim.{torch_name}":
            return _Family(builds, f"torch.optim.{torch_name}", optim, defaults, Status.EQUIVALENT,
                           note + ", the same update", optim_args, mechanics, frozenset({"fp32_optimizer_states"}))
        return _Family(builds, builds, optim, defaults, Status.EXACT, note, optim_args, mechanics)
    if lower == "lamb":
        return _Family("FusedLamb", "FusedLamb", None, {"lr": 1e-3}, Status.NOT_EXPRESSIBLE,
                       "LAMB (DeepSpeed's FusedLamb: Adam with a per-layer trust ratio) has no --optim and no "
                       f"torch.optim class: {_OWN_OPTIMIZER} (FusedLamb needs a GPU)",
                       imports=("from deepspeed.ops.lamb import FusedLamb",))
    if lower == "lion":
        cls = "DeepSpeedCPULion" if offloaded else "FusedLion"
        return _Family(cls, cls, None, {"lr": 1e-3}, Status.NOT_EXPRESSIBLE,
                       f"DeepSpeed's {cls} has no --optim (Trainer's lion_32bit is bitsandbytes' kernel, untested "
                       f"against it): {_OWN_OPTIMIZER}", imports=(f"from deepspeed.ops.lion import {cls}",))
    if lower in ("muadam", "muadamw", "musgd"):
        cls = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}[lower]
        return _Family(f"mup.{cls}", cls, None, {}, Status.NOT_EXPRESSIBLE,
                       f"muP's {cls} (the mup package) has no --optim: {_OWN_OPTIMIZER}",
                       imports=(f"from mup import {cls}",))
    if lower == "muon":
        return _Family("MuonWithAuxAdam", None, None, {}, Status.NOT_EXPRESSIBLE,
                       "DeepSpeed's Muon splits the parameters between Muon and an auxiliary Adam inside its "
                       "engine; Trainer has no --optim for it: keep DeepSpeed")
    if lower in _ONE_BIT:
        return _Family(name, None, None, {}, Status.NOT_EXPRESSIBLE,
                       f"{name} compresses the gradient all-reduce inside DeepSpeed's engine: no Trainer or torch "
                       "form; keep DeepSpeed (DeepSpeed 0.19.8 no longer lists it among its optimizers)")
    if name in _TORCH_OPTIMIZERS:
        return _Family(f"torch.optim.{name}", f"torch.optim.{name}", None, {}, Status.NOT_EXPRESSIBLE,
                       f"Trainer has no --optim for torch.optim.{name}: {_OWN_OPTIMIZER}")
    return _Family(name, None, None, {}, Status.NOT_EXPRESSIBLE,
                   f"DeepSpeed refuses {name!r}: neither one of its optimizers nor a torch.optim class (looked up "
                   "by exact name: 'SGD', 'RMSprop'); fix optimizer.type")


def _adam_family(lower: str, params: Mapping[str, Any], offloaded: bool) -> _Family:
    """DeepSpeed's Adam: type AdamW, or Adam with ``adam_w_mode`` (default true), is AdamW; ``torch_adam`` picks
    torch's class, else DeepSpeedCPUAdam under optimizer offload and FusedAdam otherwise."""
    decoupled = lower == "adamw" or bool(params.get("adam_w_mode", True))
    torch_adam = bool(params.get("torch_adam", False))
    if torch_adam:
        builds = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
    else:
        builds = ("DeepSpeedCPUAdam" if offloaded else "FusedAdam") + (" in AdamW mode" if decoupled else "")
    defaults = {**_ADAM_DEFAULTS, "weight_decay": 0.01 if builds == "torch.optim.AdamW" else 0.0}
    consumed = frozenset({"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach", "set_grad_none",
                          "bias_correction"})
    mechanics = frozenset({"foreach", "fp32_optimizer_states", "set_grad_none"})
    if decoupled:
        status = Status.EXACT if torch_adam else Status.EQUIVALENT
        note = ("DeepSpeed builds torch.optim.AdamW, as --optim adamw_torch does" if torch_adam else
                f"DeepSpeed's {builds}: torch.optim.AdamW's update (decoupled weight decay), another kernel")
        if lower == "adam" and "adam_w_mode" not in params:
            note += "; type Adam means AdamW in DeepSpeed unless adam_w_mode is false"
        return _Family(builds, "torch.optim.AdamW", "adamw_torch", defaults, status, note, mechanics=mechanics,
                       consumed=consumed, adam=True)
    decay = params.get("weight_decay", defaults["weight_decay"])
    if not isinstance(decay, bool) and isinstance(decay, (int, float)) and decay == 0:
        status = Status.EQUIVALENT
        note = "L2 Adam (adam_w_mode false) with weight_decay 0 is AdamW with weight_decay 0"
    else:
        status = Status.APPROXIMATED
        note = ("Trainer has no L2 Adam (adam_w_mode false: DeepSpeed adds weight_decay * p to the gradient, which "
                "Adam then rescales); adamw_torch decays the weights directly"
                + (", the same only with --weight_decay 0" if is_auto(decay) else "")
                + f"; to keep L2 Adam, {_OWN_OPTIMIZER}")
    return _Family(builds, "torch.optim.Adam", "adamw_torch", defaults, status, note, mechanics=mechanics,
                   consumed=consumed, adam=True)


# ----------------------------------------------------------------------------- values


def _lit(value: Any) -> str:
    """A Python literal for ``code`` and flags (floats round-trip exactly)."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_lit(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_lit(k)}: {_lit(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _number(value: Any, key: str) -> float | Auto | None:
    """A concrete number, "auto", or None when absent; anything else is the config's error."""
    if value is None:
        return None
    if is_auto(value):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number or \"auto\", got {value!r}", key=key,
                          fix="write one number (per-group lists have no TrainingArguments form)")
    return float(value)


def _steps(value: Any, key: str) -> int | Auto | None:
    """A positive step count: DeepSpeed raises on anything but a positive int."""
    if value is None:
        return None
    if is_auto(value):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"expected a positive integer or \"auto\", got {value!r} (DeepSpeed refuses it)", key=key,
                          fix="write a positive integer, or \"auto\" for Trainer to fill")
    return value


def _fraction(value: float) -> str:
    return f"{value:.3g}"


# ----------------------------------------------------------------------------- the builder


@dataclass
class _Build:
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
                self.settings[name] = (f"{name} = {_lit(TRAINER_DEFAULTS[name])}  # \"auto\": Trainer fills "
                                       f"{source}; its default here")
        return expression

    def trainer_form(self, code: str) -> TrainerForm:
        flags = dict(self.flags)
        if self.optim_args:
            flags["--optim_args"] = ",".join(f"{k}={v}" for k, v in self.optim_args.items())
        return TrainerForm(tuple(piece for key in _FLAG_ORDER if key in flags for piece in (key, flags[key])),
                           self.report, code)


@dataclass(frozen=True)
class _Optimizer:
    """The optimizer section as resolved."""

    family: _Family | None
    """None without an optimizer section."""
    params: Mapping[str, Any]
    lr: float | Auto | None
    """Its lr: concrete (given or DeepSpeed's default), "auto" (Trainer's --learning_rate; also without a section),
    or None (a default this module does not know)."""


def _optimizer_section(b: _Build, section: Any, offloaded: bool) -> _Optimizer:
    if section is None:
        b.report.add("optimizer", Status.EQUIVALENT,
                     "no optimizer section: DeepSpeed takes the caller's optimizer, and Trainer builds its own "
                     "(--optim, default adamw_torch_fused) with or without the JSON; `code` builds Trainer's default")
        return _Optimizer(None, {}, AUTO)
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ConfigError(f"expected {{\"type\": <name>, \"params\": {{...}}}}, got {section!r}", key="optimizer",
                          fix="name the optimizer in optimizer.type")
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"expected an object, got {params!r}", key="optimizer.params", fix="write params as {...}")
    for key in section:
        if key == "legacy_fusion":
            b.report.add("optimizer.legacy_fusion", Status.EQUIVALENT, "only how DeepSpeed's fp16 wrapper steps")
        elif key not in ("type", "params"):
            b.report.add(f"optimizer.{key}", Status.IGNORED, "DeepSpeed reads only type, params and legacy_fusion")
    family = _family(section["type"], params, offloaded)
    b.report.add("optimizer.type", family.status, family.note, target=f"--optim {family.optim}" if family.optim else "")
    if family.optim:
        b.flags["--optim"] = family.optim
    for key, value in params.items():
        if key == "lr":  # its entry waits for the scheduler, which may set the lr; this keeps its place
            b.report.add("optimizer.params.lr", Status.EXACT, "", target="--learning_rate")
        elif key in ("betas", "eps", "weight_decay"):
            _filled_param(b, family, key, value)
        else:
            _other_param(b, family, key, value)
    stated = ("betas", "eps", "weight_decay") if family.adam else ("weight_decay",) if family.optim else ()
    for key in stated:
        if key not in params:
            _default_param(b, family, key)
    lr = _number(params.get("lr"), "optimizer.params.lr")
    if lr is None and "lr" in family.defaults:
        lr = float(family.defaults["lr"])
    return _Optimizer(family, params, lr)


def _decay_note() -> str:
    return ("Trainer exempts biases and norm weights from weight decay (Trainer.get_decay_parameter_names), "
            f"DeepSpeed decays every parameter; to decay them all, {_OWN_OPTIMIZER}")


def _default_param(b: _Build, family: _Family, key: str) -> None:
    """An absent param: DeepSpeed's default, stated as a flag (Trainer's own defaults differ)."""
    value = family.defaults[key]
    if key == "betas":
        b.flags["--adam_beta1"], b.flags["--adam_beta2"] = _lit(float(value[0])), _lit(float(value[1]))
    else:
        b.flags[_FILLED[key]] = _lit(float(value))
    note = f"absent: {family.builds} defaults to {_lit(value)}"
    if key == "weight_decay" and value != 0:
        b.report.add(f"optimizer.params.{key}", Status.APPROXIMATED, f"{note}; {_decay_note()}", target=_FILLED[key])
    else:
        b.report.add(f"optimizer.params.{key}", Status.DEFAULT, note, target=_FILLED[key])


def _filled_param(b: _Build, family: _Family, key: str, value: Any) -> None:
    """betas, eps, weight_decay: Trainer fills "auto" from its flags and checks concrete values against them."""
    path, target = f"optimizer.params.{key}", _FILLED[key]
    takes = family.adam or key == "weight_decay" or key in family.optim_args or family.optim is None
    if not takes:
        b.left_out.append(key)
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"{family.builds} takes no {key}: DeepSpeed would fail on it "
                     "(Trainer fills an \"auto\" one from its Adam flags); remove it")
        return
    if is_auto(value):
        note = f"Trainer fills it from {target} with or without the JSON"
        if family.optim is None:
            b.report.add(path, Status.NOT_EXPRESSIBLE, f"{note}, but {family.builds} has no Trainer form: `code` "
                         "uses Trainer's default", target=target)
            return
        if key == "weight_decay":
            note += ("; a nonzero --weight_decay spares biases and norm weights in Trainer alone, while DeepSpeed "
                     "decays every parameter")
        if key == "eps" and not family.adam:
            b.optim_args["eps"] = _lit(TRAINER_DEFAULTS["adam_epsilon"])
            note += (f"; Trainer alone reads eps for {family.optim} from --optim_args, not --adam_epsilon: it is "
                     "written there at --adam_epsilon's default, keep the two equal")
            target += "/--optim_args eps"
        b.report.add(path, Status.EQUIVALENT, note, target=target)
        return
    if key == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"expected two numbers, got {value!r}", key=path, fix="write betas as [beta1, beta2]")
        beta1, beta2 = (_number(v, path) for v in value)
        b.flags["--adam_beta1"], b.flags["--adam_beta2"] = _lit(beta1), _lit(beta2)
    else:
        number = _number(value, path)
        b.flags[target] = _lit(number)
        if key == "eps" and "eps" in family.optim_args:
            b.optim_args["eps"] = _lit(number)
            target += "/--optim_args eps"
    if family.optim is None:
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"part of {family.builds}, which Trainer cannot build: `code` "
                     f"passes it; {target} is written so that Trainer accepts the JSON when it keeps the section",
                     target=target)
    elif key == "weight_decay" and _number(value, path) != 0:
        b.report.add(path, Status.APPROXIMATED, _decay_note(), target=target)
    else:
        b.report.add(path, Status.EXACT, "", target=target)


def _other_param(b: _Build, family: _Family, key: str, value: Any) -> None:
    path = f"optimizer.params.{key}"
    if is_auto(value):
        b.report.add(path, Status.NOT_EXPRESSIBLE, _NOT_FILLED)
    elif family.optim is None:
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"part of {family.builds}, which Trainer cannot build: `code` "
                     "passes it")
    elif family.adam and key == "torch_adam":
        exact = family.builds == "torch.optim.AdamW"
        b.report.add(path, Status.EXACT if exact else family.status,
                     "torch.optim.AdamW, the class --optim adamw_torch builds" if exact else
                     f"{family.builds}: {family.note}", target="--optim adamw_torch")
    elif key in family.mechanics:
        b.report.add(path, Status.EQUIVALENT, "only how the step is computed; nothing to carry")
    elif family.adam and key == "adam_w_mode":
        if value:
            b.report.add(path, Status.EXACT, "decoupled weight decay, as torch.optim.AdamW",
                         target="--optim adamw_torch")
        elif "AdamW" in family.builds:
            b.report.add(path, Status.IGNORED, "type AdamW builds AdamW whatever adam_w_mode says; write type Adam "
                         "for L2 Adam", target="--optim adamw_torch")
        else:
            b.report.add(path, family.status, family.note, target="--optim adamw_torch")
    elif family.adam and key == "bias_correction":
        b.report.add(path, Status.EXACT if value is True else Status.NOT_EXPRESSIBLE,
                     "torch.optim.AdamW always corrects the moments' bias" + ("" if value is True else
                     ": neither Trainer nor torch (nor so `code`) can turn it off; keep DeepSpeed"))
    elif family.adam and key == "amsgrad":
        b.report.add(path, Status.EXACT if value is False else Status.NOT_EXPRESSIBLE,
                     "no AMSGrad, as adamw_torch" if value is False else "FusedAdam refuses AMSGrad, and torch's "
                     f"AdamW(amsgrad=True) (torch_adam) has no Trainer flag: {_OWN_OPTIMIZER}")
    elif key in family.optim_args:
        b.optim_args[key] = _lit(value)
        b.report.add(path, Status.EXACT, f"--optim {family.optim} passes it to {family.ctor}",
                     target=f"--optim_args {key}")
    elif (key, value) in (("maximize", False), ("initial_accumulator_value", 0)):
        b.report.add(path, Status.EXACT, f"torch's default, which Trainer's {family.optim} keeps")
    else:
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"--optim {family.optim} cannot pass {key} (DeepSpeed hands it to "
                     f"{family.builds}, which fails if it does not take it): {_OWN_OPTIMIZER}")


# ----------------------------------------------------------------------------- schedulers

_WARMUP_PARAMS: Mapping[str, frozenset[str]] = {
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
_TORCH_SCHEDULERS = frozenset({"LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                               "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler",
                               "ReduceLROnPlateau", "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
                               "PolynomialLR"})
"""torch.optim.lr_scheduler classes, which DeepSpeed builds by name when lr_schedules has none."""
_DECAY_DEFAULT_PEAK = 0.001
"""WarmupDecayLR's warmup_max_lr default: unlike WarmupLR (None: the optimizer's lr), a fixed 0.001."""


@dataclass(frozen=True)
class _Warmup:
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
class _Other:
    """A scheduler Trainer has no form for: DeepSpeed's own class, a torch one, or one DeepSpeed refuses."""

    name: str
    params: Mapping[str, Any]
    where: str
    """``deepspeed``, ``torch`` or ``unknown``."""


def _scheduler_section(b: _Build, section: Any) -> _Warmup | _Other | None:
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
    if name in _WARMUP_PARAMS:
        return _warmup(b, name, params)
    if name in _DEEPSPEED_OTHERS or name in _TORCH_SCHEDULERS:
        where = "deepspeed" if name in _DEEPSPEED_OTHERS else "torch"
        why = _DEEPSPEED_OTHERS.get(name) or f"Trainer has no --lr_scheduler_type for torch.optim.lr_scheduler.{name}"
        b.report.add("scheduler.type", Status.NOT_EXPRESSIBLE, f"{why}; Trainer alone would use its linear decay: "
                     f"{_OWN_SCHEDULER}")
        for key in params:
            b.report.add(f"scheduler.params.{key}", Status.NOT_EXPRESSIBLE,
                         _NOT_FILLED if is_auto(params[key]) else f"part of {name}: `code` passes it")
        return _Other(name, params, where)
    b.report.add("scheduler.type", Status.NOT_EXPRESSIBLE, f"DeepSpeed refuses {name!r}: neither "
                 "deepspeed.runtime.lr_schedules nor torch.optim.lr_scheduler has it (names are exact); fix "
                 "scheduler.type")
    for key in params:
        b.report.add(f"scheduler.params.{key}", Status.NOT_EXPRESSIBLE, f"part of {name}, which DeepSpeed refuses")
    return _Other(name, params, "unknown")


def _warmup(b: _Build, kind: str, params: Mapping[str, Any]) -> _Warmup:
    report, p = b.report, "scheduler.params."
    _type_entry(report, "")
    for key in params:
        if key not in _WARMUP_PARAMS[kind]:
            report.add(p + key, Status.NOT_EXPRESSIBLE, f"{kind} takes no {key}: DeepSpeed fails on it (TypeError); "
                       "remove it")
    warmup = _steps(params.get("warmup_num_steps"), p + "warmup_num_steps")
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
        total = _steps(params.get("total_num_steps"), p + "total_num_steps")
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
    given = _number(params.get("warmup_min_lr"), p + "warmup_min_lr")
    start = given if isinstance(given, float) else 0.0
    if is_auto(given):
        report.add(p + "warmup_min_lr", Status.EQUIVALENT, "Trainer fills 0 (it has no flag for it)")
    elif given == 0:
        report.add(p + "warmup_min_lr", Status.EXACT, "Trainer warms up from 0")
    elif given is not None:
        report.add(p + "warmup_min_lr", Status.APPROXIMATED, "Trainer warms up from 0" + (
            "" if kind == "WarmupLR" else " and decays to 0, where DeepSpeed decays to warmup_min_lr"))
    peak = _number(params.get("warmup_max_lr"), p + "warmup_max_lr")
    if peak is None and kind == "WarmupDecayLR":
        peak = _DECAY_DEFAULT_PEAK
        report.add(p + "warmup_max_lr", Status.DEFAULT, "absent: WarmupDecayLR peaks at its default 0.001, not at "
                   "the optimizer's lr", target="--learning_rate")
    elif is_auto(peak):
        report.add(p + "warmup_max_lr", Status.EQUIVALENT, "Trainer fills it from --learning_rate",
                   target="--learning_rate")
    elif peak is not None:
        report.add(p + "warmup_max_lr", Status.EXACT, "Trainer's schedule peaks at --learning_rate",
                   target="--learning_rate")
    b.flags["--lr_scheduler_type"] = _TRAINER_TYPE[kind]
    return _Warmup(kind, warmup, total, log, start, 0.0, None if is_auto(peak) else peak)


def _type_entry(report: Report, note: str) -> None:
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


def _cosine(b: _Build, params: Mapping[str, Any], warmup: int | Auto, total: int | Auto | None,
            log: bool) -> _Warmup:
    report, p = b.report, "scheduler.params."
    start = _number(params.get("warmup_min_ratio"), p + "warmup_min_ratio")
    if is_auto(start):
        report.add(p + "warmup_min_ratio", Status.NOT_EXPRESSIBLE, f"{_NOT_FILLED}; `code` uses the default 0.0")
        start = 0.0
    elif start is not None:
        report.add(p + "warmup_min_ratio", Status.EXACT if start == 0 else Status.APPROXIMATED,
                   "Trainer warms up from 0" + ("" if start == 0 else ", DeepSpeed from warmup_min_ratio x lr"))
    cos_min = _number(params.get("cos_min_ratio"), p + "cos_min_ratio")
    if cos_min is None or is_auto(cos_min):
        note = "absent: WarmupCosineLR decays to its default 0.0001 x lr" if cos_min is None else \
            f"{_NOT_FILLED}; the default 0.0001 is written"
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
    return _Warmup("WarmupCosineLR", warmup, total, log, start or 0.0, cos_min, None)


# ----------------------------------------------------------------------------- the gap between the two schedules


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


def _gap_note(w: _Warmup, peak: float | Auto | None) -> str:
    """The scheduler.type note: where Trainer's schedule departs from DeepSpeed's, and by how much."""
    first = ("DeepSpeed gives optimizer step 0 lr 0 and step 1 warmup_min_ratio x lr" if w.kind == "WarmupCosineLR"
             else "DeepSpeed gives optimizer steps 0 and 1 warmup_min_lr")
    parts = [f"one-step lag: {first}, then each warmup value one step after Trainer"]
    start: float | None = w.start
    if w.kind != "WarmupCosineLR" and start:
        start = start / peak if isinstance(peak, float) and peak else None
    warmup = _ILLUSTRATIVE_WARMUP if is_auto(w.warmup) else w.warmup
    total = w.total if isinstance(w.total, int) else None
    if start is None:
        parts.append("the size of the gap depends on --learning_rate (warmup_min_lr is absolute)")
    else:
        gap, step = _Shape(w.kind, warmup, total, w.log, start, w.cos_min).gap()
        size = f" ({_fraction(gap * peak)})" if isinstance(peak, float) else ""
        where = f"with {warmup} warmup steps (warmup_num_steps is \"auto\"), " if is_auto(w.warmup) else ""
        span = "over the run" if total is not None or w.kind == "WarmupLR" else "over the warmup"
        parts.append(f"{where}Trainer's lr differs {span} by at most {_fraction(gap)} of the peak lr{size}, first "
                     f"at step {step}" + (" (log warmup against Trainer's linear one)" if w.log else ""))
    if w.kind == "WarmupDecayLR":
        parts.append("the linear decay lags one step too, (1 - warmup_min_lr / peak) / (total_num_steps - "
                     "warmup_num_steps) of the peak lr" + ("" if not w.start else ", and ends at warmup_min_lr where "
                                                         "Trainer ends at 0"))
    if w.kind == "WarmupCosineLR":
        parts.append("from step warmup_num_steps + 1 on, the cosine decay is exactly Trainer's")
    parts.append("`code` reproduces DeepSpeed's schedule exactly")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- the learning rate


def _learning_rate(b: _Build, opt: _Optimizer, sched: _Warmup | _Other | None) -> str:
    """Write --learning_rate (the lr Trainer's schedule peaks at), report optimizer.params.lr, and return the
    ``code`` expression of that lr."""
    peak_from_scheduler = isinstance(sched, _Warmup) and sched.peak is not None
    lr: float | Auto | None = sched.peak if isinstance(sched, _Warmup) and sched.peak is not None else opt.lr
    if isinstance(lr, float):
        b.flags["--learning_rate"] = _lit(lr)
    family, given = opt.family, _number(opt.params.get("lr"), "optimizer.params.lr")
    key = "optimizer.params.lr"
    if family is not None and given is not None:
        if family.optim is None:
            b.report.add(key, Status.NOT_EXPRESSIBLE, f"part of {family.builds}, which Trainer cannot build: `code` "
                         "passes it; --learning_rate sets the schedule's peak", target="--learning_rate")
        elif is_auto(given):
            source = " (written from scheduler.params.warmup_max_lr)" if peak_from_scheduler else ""
            b.report.add(key, Status.EQUIVALENT, f"Trainer fills it from --learning_rate{source}",
                         target="--learning_rate")
        elif peak_from_scheduler and given != lr:
            b.report.add(key, Status.IGNORED, f"DeepSpeed's scheduler sets the lr (peak {_lit(lr)}), so this value "
                         f"never takes effect; Trainer with this JSON kept refuses the mismatch: set it to {_lit(lr)} "
                         "or \"auto\"", target="--learning_rate")
        else:
            b.report.add(key, Status.EXACT, "", target="--learning_rate")
    elif family is not None and family.optim and not peak_from_scheduler and isinstance(lr, float):
        b.report.add(key, Status.DEFAULT, f"absent: {family.builds} defaults to {_lit(lr)}",
                     target="--learning_rate")
    if isinstance(lr, float):
        return _lit(lr)
    if is_auto(lr):
        return b.auto_var("learning_rate")
    return ""


# ----------------------------------------------------------------------------- code


def _optimizer_code(b: _Build, opt: _Optimizer, lr: str) -> list[str]:
    family = opt.family
    if family is None:
        return ["# No optimizer section: DeepSpeed takes the caller's optimizer. This is Trainer's default (it also "
                "spares", "# biases and norm weights from weight decay, 0.0 by default).",
                *_call("optimizer", "torch.optim.AdamW", ["model.parameters()", f"lr={lr}", "betas=(0.9, 0.999)",
                                                          "eps=1e-08", "weight_decay=0.0"])]
    if family.ctor is None:
        return [f"raise NotImplementedError({family.note!r})"]
    kwargs: dict[str, str] = {"lr": lr} if lr else {}
    for key in ("betas", "eps", "weight_decay"):
        if key in family.defaults:
            kwargs[key] = _lit(family.defaults[key])
    for key, value in opt.params.items():
        if key == "lr" or key in b.left_out or (key in family.consumed and family.optim is not None):
            continue
        if is_auto(value):
            if key in _AUTO_VARS:
                kwargs[key] = b.auto_var(_AUTO_VARS[key])
            continue
        kwargs[key] = _lit(value)
    lines = [f"# DeepSpeed builds {family.builds}." + (" This is its update in torch." if family.ctor != family.builds
                                                        else "")]
    if b.left_out:
        lines.append(f"# Left out: {', '.join(b.left_out)} ({family.ctor} takes none; DeepSpeed would fail on them).")
    return [*lines, *_call("optimizer", family.ctor, ["model.parameters()", *(f"{k}={v}" for k, v in kwargs.items())])]


def _call(name: str, ctor: str, args: list[str]) -> list[str]:
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


def _scheduler_code(b: _Build, sched: _Warmup | _Other | None, lr: str) -> tuple[list[str], list[str], bool]:
    """The scheduler's imports and lines, and whether they use ``total_steps``."""
    if sched is None:
        return [], ["# No scheduler section: DeepSpeed keeps the lr constant.",
                    "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)"], False
    if isinstance(sched, _Other):
        if sched.where == "unknown":
            return [], [f"raise NotImplementedError({f'DeepSpeed has no scheduler {sched.name!r}'!r})"], False
        args = ["optimizer", *(f"{k}={_lit(v)}" for k, v in sched.params.items() if not is_auto(v))]
        if sched.where == "deepspeed":
            return ([f"from deepspeed.runtime.lr_schedules import {sched.name}  # no torch form: DeepSpeed's own"],
                    _call("scheduler", sched.name, args), False)
        return [], _call("scheduler", f"torch.optim.lr_scheduler.{sched.name}", args), False
    warmup = b.auto_var("warmup_num_steps") if is_auto(sched.warmup) else str(sched.warmup)
    total = "total_steps" if is_auto(sched.total) else str(sched.total)
    growth = "1.0 / math.log(WARMUP) * math.log(i + 1)" if sched.log else "i / WARMUP"
    lines = [f"# DeepSpeed's {sched.kind}, {'log' if sched.log else 'linear'} warmup, one step behind as DeepSpeed "
             "runs it: optimizer", "# step k gets its value at last_batch_iteration k - 1 (-1 when it is built)."]
    if sched.kind == "WarmupCosineLR":
        lines += [f"WARMUP_MIN_RATIO, COS_MIN_RATIO = {_lit(sched.start)}, {_lit(sched.cos_min)}",
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
    lines += [f"MIN_LR, MAX_LR = {_lit(sched.start)}, {peak}",
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


def _code(b: _Build, opt: _Optimizer, sched: _Warmup | _Other | None, lr: str) -> str:
    optimizer = _optimizer_code(b, opt, lr)
    imports, scheduler, total = _scheduler_code(b, sched, lr)
    what = "`model` (a torch.nn.Module)" + (" and `total_steps` (the run's optimizer steps) exist" if total
                                            else " exists")
    family = opt.family
    head = [f"# Assumes {what}.",
            "# Call scheduler.step() after every optimizer.step(), as DeepSpeed's engine does.",
            *(["import math", ""] if isinstance(sched, _Warmup) else []), "import torch",
            *(family.imports if family and family.ctor else ()), *imports]
    settings = list(b.settings.values())
    return "\n".join([*head, "", *settings, *([""] if settings else []), *optimizer, *scheduler]) + "\n"


# ----------------------------------------------------------------------------- entry point


def trainer_form_of(spec: StrategySpec) -> TrainerForm:
    """The ``TrainingArguments`` flags, report and torch code that rebuild the optimizer and scheduler of the
    DeepSpeed JSON ``spec`` was read from (``spec.passthrough["deepspeed"]``)."""
    sections = spec.passthrough.get("deepspeed", {})
    b = _Build()
    opt = _optimizer_section(b, sections.get("optimizer"), spec.offload.optimizer.enabled)
    sched = _scheduler_section(b, sections.get("scheduler"))
    lr = _learning_rate(b, opt, sched)
    if isinstance(sched, _Warmup):
        _type_entry(b.report, _gap_note(sched, sched.peak if sched.peak is not None else opt.lr))
    return b.trainer_form(_code(b, opt, sched, lr))
