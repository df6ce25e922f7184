"""The optimizer section of a DeepSpeed JSON as Trainer flags, report entries and torch code (``trainer_args``).

    >>> from zerobridge.translate.trainer_build import Build
    >>> from zerobridge.translate.trainer_optimizer import optimizer_section
    >>> b = Build()
    >>> section = optimizer_section(b, {"type": "AdamW", "params": {"lr": 3e-4}}, offloaded=False)
    >>> section.family.builds, b.flags["--optim"], section.lr
    ('FusedAdam in AdamW mode', 'adamw_torch', 0.0003)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec.base import AUTO, Auto, is_auto
from zerobridge.translate.report import Status
from zerobridge.translate.trainer_build import (
    AUTO_VARS,
    FILLED,
    NOT_FILLED,
    OWN_OPTIMIZER,
    TRAINER_DEFAULTS,
    Build,
    as_number,
    call,
    lit,
)

__all__ = ["ADAM_DEFAULTS", "TORCH_FAMILIES", "TORCH_OPTIMIZERS", "Family", "OptimizerSection", "optimizer_code",
           "optimizer_section"]


@dataclass(frozen=True)
class Family:
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


ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
"""FusedAdam's, DeepSpeedCPUAdam's and torch's Adam/AdamW defaults (weight_decay differs: set per class)."""
TORCH_FAMILIES: Mapping[str, tuple[str, Mapping[str, Any], frozenset[str], frozenset[str]]] = {
    "SGD": ("sgd", {"lr": 1e-3, "weight_decay": 0.0}, frozenset({"momentum", "dampening", "nesterov"}),
            frozenset({"foreach", "differentiable", "fused"})),
    "Adagrad": ("adagrad", {"lr": 1e-2, "weight_decay": 0.0}, frozenset({"lr_decay", "eps"}),
                frozenset({"foreach", "differentiable", "fused", "fp32_optimizer_states"})),
    "RMSprop": ("rmsprop", {"lr": 1e-2, "weight_decay": 0.0}, frozenset({"alpha", "eps", "momentum", "centered"}),
                frozenset({"capturable", "foreach", "differentiable"})),
}
"""torch.optim classes Trainer has an ``--optim`` for: (optim, defaults the flags state, ``--optim_args`` keys,
mechanics). DeepSpeed passes the JSON's params to the same class, so the defaults are torch's."""
TORCH_OPTIMIZERS = frozenset({"ASGD", "Adadelta", "Adafactor", "Adamax", "LBFGS", "NAdam", "RAdam", "Rprop",
                               "SparseAdam"})
"""Other torch.optim classes: DeepSpeed builds them by exact name (``getattr(torch.optim, type)``)."""
_ONE_BIT = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


def _family(name: str, params: Mapping[str, Any], offloaded: bool) -> Family:
    """How DeepSpeed's engine (``_configure_basic_optimizer``) reads ``type``: its own optimizers case-insensitively
    (adagrad, adam, adamw, lamb, lion, muadam, muadamw, musgd, muon), any other by its exact torch.optim name."""
    lower = name.lower()
    if lower in ("adam", "adamw"):
        return _adam_family(lower, params, offloaded)
    if lower == "adagrad" or name in TORCH_FAMILIES:
        torch_name = "Adagrad" if lower == "adagrad" else name
        optim, defaults, optim_args, mechanics = TORCH_FAMILIES[torch_name]
        builds = "DeepSpeedCPUAdagrad" if offloaded and lower == "adagrad" else f"torch.optim.{torch_name}"
        note = f"DeepSpeed builds {builds}; --optim {optim} builds torch.optim.{torch_name}"
        if builds != f"torch.optim.{torch_name}":
            return Family(builds, f"torch.optim.{torch_name}", optim, defaults, Status.EQUIVALENT,
                           note + ", the same update", optim_args, mechanics, frozenset({"fp32_optimizer_states"}))
        return Family(builds, builds, optim, defaults, Status.EXACT, note, optim_args, mechanics)
    if lower == "lamb":
        return Family("FusedLamb", "FusedLamb", None, {"lr": 1e-3}, Status.NOT_EXPRESSIBLE,
                       "LAMB (DeepSpeed's FusedLamb: Adam with a per-layer trust ratio) has no --optim and no "
                       f"torch.optim class: {OWN_OPTIMIZER} (FusedLamb needs a GPU)",
                       imports=("from deepspeed.ops.lamb import FusedLamb",))
    if lower == "lion":
        cls = "DeepSpeedCPULion" if offloaded else "FusedLion"
        return Family(cls, cls, None, {"lr": 1e-3}, Status.NOT_EXPRESSIBLE,
                       f"DeepSpeed's {cls} has no --optim (Trainer's lion_32bit is bitsandbytes' kernel, untested "
                       f"against it): {OWN_OPTIMIZER}", imports=(f"from deepspeed.ops.lion import {cls}",))
    if lower in ("muadam", "muadamw", "musgd"):
        cls = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}[lower]
        return Family(f"mup.{cls}", cls, None, {}, Status.NOT_EXPRESSIBLE,
                       f"muP's {cls} (the mup package) has no --optim: {OWN_OPTIMIZER}",
                       imports=(f"from mup import {cls}",))
    if lower == "muon":
        return Family("MuonWithAuxAdam", None, None, {}, Status.NOT_EXPRESSIBLE,
                       "DeepSpeed's Muon splits the parameters between Muon and an auxiliary Adam inside its "
                       "engine; Trainer has no --optim for it: keep DeepSpeed")
    if lower in _ONE_BIT:
        return Family(name, None, None, {}, Status.NOT_EXPRESSIBLE,
                       f"{name} compresses the gradient all-reduce inside DeepSpeed's engine: no Trainer or torch "
                       "form; keep DeepSpeed (DeepSpeed 0.19.8 no longer lists it among its optimizers)")
    if name in TORCH_OPTIMIZERS:
        return Family(f"torch.optim.{name}", f"torch.optim.{name}", None, {}, Status.NOT_EXPRESSIBLE,
                       f"Trainer has no --optim for torch.optim.{name}: {OWN_OPTIMIZER}")
    return Family(name, None, None, {}, Status.NOT_EXPRESSIBLE,
                   f"DeepSpeed refuses {name!r}: neither one of its optimizers nor a torch.optim class (looked up "
                   "by exact name: 'SGD', 'RMSprop'); fix optimizer.type")


def _adam_family(lower: str, params: Mapping[str, Any], offloaded: bool) -> Family:
    """DeepSpeed's Adam: type AdamW, or Adam with ``adam_w_mode`` (default true), is AdamW; ``torch_adam`` picks
    torch's class, else DeepSpeedCPUAdam under optimizer offload and FusedAdam otherwise."""
    decoupled = lower == "adamw" or bool(params.get("adam_w_mode", True))
    torch_adam = bool(params.get("torch_adam", False))
    if torch_adam:
        builds = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
    else:
        builds = ("DeepSpeedCPUAdam" if offloaded else "FusedAdam") + (" in AdamW mode" if decoupled else "")
    defaults = {**ADAM_DEFAULTS, "weight_decay": 0.01 if builds == "torch.optim.AdamW" else 0.0}
    consumed = frozenset({"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach", "set_grad_none",
                          "bias_correction"})
    mechanics = frozenset({"foreach", "fp32_optimizer_states", "set_grad_none"})
    if decoupled:
        status = Status.EXACT if torch_adam else Status.EQUIVALENT
        note = ("DeepSpeed builds torch.optim.AdamW, as --optim adamw_torch does" if torch_adam else
                f"DeepSpeed's {builds}: torch.optim.AdamW's update (decoupled weight decay), another kernel")
        if lower == "adam" and "adam_w_mode" not in params:
            note += "; type Adam means AdamW in DeepSpeed unless adam_w_mode is false"
        return Family(builds, "torch.optim.AdamW", "adamw_torch", defaults, status, note, mechanics=mechanics,
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
                + f"; to keep L2 Adam, {OWN_OPTIMIZER}")
    return Family(builds, "torch.optim.Adam", "adamw_torch", defaults, status, note, mechanics=mechanics,
                   consumed=consumed, adam=True)



@dataclass(frozen=True)
class OptimizerSection:
    """The optimizer section as resolved."""

    family: Family | None
    """None without an optimizer section."""
    params: Mapping[str, Any]
    lr: float | Auto | None
    """Its lr: concrete (given or DeepSpeed's default), "auto" (Trainer's --learning_rate; also without a section),
    or None (a default this module does not know)."""


def optimizer_section(b: Build, section: Any, offloaded: bool) -> OptimizerSection:
    if section is None:
        b.report.add("optimizer", Status.EQUIVALENT,
                     "no optimizer section: DeepSpeed takes the caller's optimizer, and Trainer builds its own "
                     "(--optim, default adamw_torch_fused) with or without the JSON; `code` builds Trainer's default")
        return OptimizerSection(None, {}, AUTO)
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
    lr = as_number(params.get("lr"), "optimizer.params.lr")
    if lr is None and "lr" in family.defaults:
        lr = float(family.defaults["lr"])
    return OptimizerSection(family, params, lr)


def _decay_note() -> str:
    return ("Trainer exempts biases and norm weights from weight decay (Trainer.get_decay_parameter_names), "
            f"DeepSpeed decays every parameter; to decay them all, {OWN_OPTIMIZER}")


def _default_param(b: Build, family: Family, key: str) -> None:
    """An absent param: DeepSpeed's default, stated as a flag (Trainer's own defaults differ)."""
    value = family.defaults[key]
    if key == "betas":
        b.flags["--adam_beta1"], b.flags["--adam_beta2"] = lit(float(value[0])), lit(float(value[1]))
    else:
        b.flags[FILLED[key]] = lit(float(value))
    note = f"absent: {family.builds} defaults to {lit(value)}"
    if key == "weight_decay" and value != 0:
        b.report.add(f"optimizer.params.{key}", Status.APPROXIMATED, f"{note}; {_decay_note()}", target=FILLED[key])
    else:
        b.report.add(f"optimizer.params.{key}", Status.DEFAULT, note, target=FILLED[key])


def _filled_param(b: Build, family: Family, key: str, value: Any) -> None:
    """betas, eps, weight_decay: Trainer fills "auto" from its flags and checks concrete values against them."""
    path, target = f"optimizer.params.{key}", FILLED[key]
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
            b.optim_args["eps"] = lit(TRAINER_DEFAULTS["adam_epsilon"])
            note += (f"; Trainer alone reads eps for {family.optim} from --optim_args, not --adam_epsilon: it is "
                     "written there at --adam_epsilon's default, keep the two equal")
            target += "/--optim_args eps"
        b.report.add(path, Status.EQUIVALENT, note, target=target)
        return
    if key == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"expected two numbers, got {value!r}", key=path, fix="write betas as [beta1, beta2]")
        beta1, beta2 = (as_number(v, path) for v in value)
        b.flags["--adam_beta1"], b.flags["--adam_beta2"] = lit(beta1), lit(beta2)
    else:
        number = as_number(value, path)
        b.flags[target] = lit(number)
        if key == "eps" and "eps" in family.optim_args:
            b.optim_args["eps"] = lit(number)
            target += "/--optim_args eps"
    if family.optim is None:
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"part of {family.builds}, which Trainer cannot build: `code` "
                     f"passes it; {target} is written so that Trainer accepts the JSON when it keeps the section",
                     target=target)
    elif key == "weight_decay" and as_number(value, path) != 0:
        b.report.add(path, Status.APPROXIMATED, _decay_note(), target=target)
    else:
        b.report.add(path, Status.EXACT, "", target=target)


def _other_param(b: Build, family: Family, key: str, value: Any) -> None:
    path = f"optimizer.params.{key}"
    if is_auto(value):
        b.report.add(path, Status.NOT_EXPRESSIBLE, NOT_FILLED)
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
                     f"AdamW(amsgrad=True) (torch_adam) has no Trainer flag: {OWN_OPTIMIZER}")
    elif key in family.optim_args:
        b.optim_args[key] = lit(value)
        b.report.add(path, Status.EXACT, f"--optim {family.optim} passes it to {family.ctor}",
                     target=f"--optim_args {key}")
    elif (key, value) in (("maximize", False), ("initial_accumulator_value", 0)):
        b.report.add(path, Status.EXACT, f"torch's default, which Trainer's {family.optim} keeps")
    else:
        b.report.add(path, Status.NOT_EXPRESSIBLE, f"--optim {family.optim} cannot pass {key} (DeepSpeed hands it to "
                     f"{family.builds}, which fails if it does not take it): {OWN_OPTIMIZER}")


def optimizer_code(b: Build, opt: OptimizerSection, lr: str) -> list[str]:
    family = opt.family
    if family is None:
        return ["# No optimizer section: DeepSpeed takes the caller's optimizer. This is Trainer's default (it also "
                "spares", "# biases and norm weights from weight decay, 0.0 by default).",
                *call("optimizer", "torch.optim.AdamW", ["model.parameters()", f"lr={lr}", "betas=(0.9, 0.999)",
                                                          "eps=1e-08", "weight_decay=0.0"])]
    if family.ctor is None:
        return [f"raise NotImplementedError({family.note!r})"]
    kwargs: dict[str, str] = {"lr": lr} if lr else {}
    for key in ("betas", "eps", "weight_decay"):
        if key in family.defaults:
            kwargs[key] = lit(family.defaults[key])
    for key, value in opt.params.items():
        if key == "lr" or key in b.left_out or (key in family.consumed and family.optim is not None):
            continue
        if is_auto(value):
            if key in AUTO_VARS:
                kwargs[key] = b.auto_var(AUTO_VARS[key])
            continue
        kwargs[key] = lit(value)
    lines = [f"# DeepSpeed builds {family.builds}." + (" This is its update in torch." if family.ctor != family.builds
                                                        else "")]
    if b.left_out:
        lines.append(f"# Left out: {', '.join(b.left_out)} ({family.ctor} takes none; DeepSpeed would fail on them).")
    return [*lines, *call("optimizer", family.ctor, ["model.parameters()", *(f"{k}={v}" for k, v in kwargs.items())])]
