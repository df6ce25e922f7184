"""A DeepSpeed JSON's ``optimizer`` section, built as the plain torch optimizer that makes DeepSpeed's update.

    >>> import torch
    >>> from zerobridge.runtime.optimizers import build_optimizer, resolve_optimizer
    >>> model = torch.nn.Linear(4, 2)
    >>> section = {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}}
    >>> optimizer = build_optimizer(section, model.parameters())
    >>> type(optimizer).__name__, optimizer.defaults["weight_decay"]
    ('AdamW', 0.0)
    >>> choice = resolve_optimizer(section, offloaded=True)
    >>> choice.deepspeed_builds, choice.exact
    ('DeepSpeedCPUAdam(adamw_mode=True)', False)

Every zerobridge backend runs the section's optimizer as a torch object whose numbers are DeepSpeed's. The type is
read the way DeepSpeed's engine reads it (``DeepSpeedEngine._configure_basic_optimizer``): its own optimizers by
name in any case (``adam``, ``adamw``, ``adagrad``, ``lamb``, ``lion``, ``muadam``, ``muadamw``, ``musgd``,
``muon``), any other as a ``torch.optim`` class by its exact name (``"SGD"``, ``"RMSprop"``).

- Adam or AdamW with ``torch_adam``: DeepSpeed builds torch.optim.AdamW (torch.optim.Adam for Adam with
  ``adam_w_mode: false``) with the params as keywords; so does zerobridge. Exact.
- Adam or AdamW otherwise: DeepSpeed builds FusedAdam, or DeepSpeedCPUAdam when the optimizer is offloaded
  (``offloaded``). zerobridge builds torch.optim.AdamW (decoupled decay), or torch.optim.Adam (L2 decay) for
  Adam with ``adam_w_mode: false``, with their defaults stated: ``weight_decay`` 0.0, not torch AdamW's 0.01.
  The same update, in float32 C++/CUDA kernels: equal to rounding, not bitwise.
- Adagrad: torch.optim.Adagrad (exact); offloaded, DeepSpeed builds DeepSpeedCPUAdagrad (lr 1e-2, eps 1e-10,
  weight_decay 0: torch's defaults, the same update).
- SGD, RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, Adafactor, SparseAdam: that torch.optim class with
  the params as keywords, as DeepSpeed builds it. Exact.

Refused, with a ``ConfigError`` that names the fix (keep ``backend="deepspeed"``, or build the optimizer yourself
and pass it to ``zerobridge.prepare(model, optimizer, ...)``): Lamb (FusedLamb), Lion (FusedLion / CPU Lion),
MuAdam, MuAdamW, MuSGD (the ``mup`` package), Muon (DeepSpeed's Muon with an auxiliary Adam, split by its engine),
OneBitAdam, ZeroOneAdam, OneBitLamb (compressed all-reduce inside DeepSpeed's engine), LBFGS (its step needs a
closure that no engine passes); Adam without ``bias_correction`` (no torch optimizer skips it) and FusedAdam's
or DeepSpeedCPUAdam's ``amsgrad`` (DeepSpeed refuses it too; ``torch_adam`` has it); ``max_grad_norm`` (DeepSpeed
refuses it: ``gradient_clipping``); params the class DeepSpeed would build does not take (DeepSpeed fails on them
with a TypeError); and "auto", which only Hugging Face Trainer fills.

Mechanics that change no number are accepted and dropped: ``fp32_optimizer_states`` (state dtype of the C++
kernels), ``set_grad_none`` (FusedAdam's ``zero_grad``), DeepSpeedCPUAdagrad's ``amsgrad`` (it ignores it). As
DeepSpeed's engine does, param groups left without parameters are removed after the optimizer is built. Whether
ZeRO accepts a torch optimizer (``zero_allow_untested_optimizer``) is DeepSpeed's engine's check, not made here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zerobridge.errors import ConfigError, closest
from zerobridge.spec import is_auto

__all__ = ["OptimizerChoice", "build_optimizer", "resolve_optimizer"]

OWN_OPTIMIZER = ("keep backend=\"deepspeed\" for it, or build the optimizer yourself and pass it: "
                 "zerobridge.prepare(model, optimizer, ...)")
"""The fix for an optimizer no torch class reproduces."""

_ADAM_POPPED = frozenset({"adam_w_mode", "torch_adam", "fp32_optimizer_states"})
"""Params DeepSpeed's engine reads itself for Adam and AdamW and never passes on."""
_FUSED_ADAM_TAKES = frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none"})
_CPU_ADAM_TAKES = frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"})
_CPU_ADAGRAD_TAKES = frozenset({"lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"})
_ADAM_DEFAULTS: Mapping[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
"""FusedAdam's and DeepSpeedCPUAdam's defaults (weight_decay 0, where torch.optim.AdamW has 0.01)."""
_CPU_ADAGRAD_DEFAULTS: Mapping[str, Any] = {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}

_REFUSED: Mapping[str, str] = {
    "lamb": "DeepSpeed builds FusedLamb (Adam with a per-layer trust ratio, a CUDA kernel); torch has no LAMB",
    "lion": "DeepSpeed builds FusedLion (DeepSpeedCPULion when offloaded); torch has no Lion",
    "muadam": "DeepSpeed builds mup.MuAdam (the mup package, which scales each parameter's lr by its width); "
              "it is no torch.optim class",
    "muadamw": "DeepSpeed builds mup.MuAdamW (the mup package, which scales each parameter's lr by its width); "
               "it is no torch.optim class",
    "musgd": "DeepSpeed builds mup.MuSGD (the mup package, which scales each parameter's lr by its width); "
             "it is no torch.optim class",
    "muon": "DeepSpeed builds MuonWithAuxAdam: Muon for the parameters its engine tags use_muon, an auxiliary "
            "Adam for the rest; torch.optim.Muon alone is not that optimizer",
    "onebitadam": "OneBitAdam compresses the gradient all-reduce inside DeepSpeed's engine (and DeepSpeed 0.19.8 "
                  "no longer builds it by name); no torch optimizer does that",
    "zerooneadam": "ZeroOneAdam compresses the gradient all-reduce inside DeepSpeed's engine (and DeepSpeed 0.19.8 "
                   "no longer builds it by name); no torch optimizer does that",
    "onebitlamb": "OneBitLamb compresses the gradient all-reduce inside DeepSpeed's engine (and DeepSpeed 0.19.8 "
                  "no longer builds it by name); no torch optimizer does that",
}
"""Optimizer types (lower case) no torch class reproduces, and why."""

_TORCH_OPTIMIZERS: Mapping[str, type[torch.optim.Optimizer]] = {
    name: value for name in dir(torch.optim) if isinstance(value := getattr(torch.optim, name), type)
    and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
}
"""``torch.optim`` classes by name: DeepSpeed builds one by its exact name (Adam, AdamW, Adagrad and Muon are
DeepSpeed's own names, read before)."""
_NEEDS_CLOSURE = frozenset({"LBFGS"})


@dataclass(frozen=True)
class OptimizerChoice:
    """What DeepSpeed's engine builds for one optimizer section, and the torch class that makes the same update."""

    name: str
    """``optimizer.type`` as written."""
    deepspeed_builds: str
    """The class DeepSpeed instantiates, with the mode its engine passes (``FusedAdam(adam_w_mode=True)``)."""
    torch_class: type[torch.optim.Optimizer]
    """The class zerobridge builds."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Its keyword arguments: the section's params with DeepSpeed's defaults stated where torch's differ."""
    exact: bool = True
    """True when DeepSpeed builds ``torch_class`` itself with ``kwargs``; False when it builds its own kernel of
    the same update (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad: equal up to float32 rounding)."""

    def build(self, params: Iterable[torch.nn.Parameter] | list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (parameters, or param-group dicts), without empty param groups."""
        try:
            optimizer = self.torch_class(params, **self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.torch_class.__name__} refuses it: {exc}", key="optimizer.params",
                              fix="fix the value (or the param groups) it names") from exc
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if len(group["params"]) != 0]
        return optimizer


def build_optimizer(section: Mapping[str, Any], params: Iterable[torch.nn.Parameter] | list[dict[str, Any]], *,
                    offloaded: bool = False) -> torch.optim.Optimizer:
    """The torch optimizer over ``params`` that makes the update DeepSpeed builds for ``section`` (a DeepSpeed
    JSON's ``optimizer``: ``{"type": ..., "params": {...}}``); ``offloaded``: the optimizer is offloaded to the
    CPU (``zero_optimization.offload_optimizer``), where DeepSpeed picks its CPU kernels and their defaults."""
    return resolve_optimizer(section, offloaded=offloaded).build(params)


def resolve_optimizer(section: Mapping[str, Any], *, offloaded: bool = False) -> OptimizerChoice:
    """What DeepSpeed builds for ``section`` and the torch class and keywords that reproduce it; a
    ``ConfigError`` when no torch optimizer does, or DeepSpeed would refuse the section."""
    name, params = _read_section(section)
    if "max_grad_norm" in params:
        raise ConfigError("DeepSpeed refuses max_grad_norm as an optimizer param (ValueError)",
                          key="optimizer.params.max_grad_norm",
                          fix="remove it and set \"gradient_clipping\" at the top of the JSON")
    lower = name.lower()
    if lower in ("adam", "adamw"):
        return _adam(name, lower == "adamw", params, offloaded)
    if lower == "adagrad":
        if offloaded:
            _only(params, _CPU_ADAGRAD_TAKES, "DeepSpeedCPUAdagrad")
            kwargs = {**_CPU_ADAGRAD_DEFAULTS, **{k: v for k, v in params.items() if k in ("lr", "eps",
                                                                                           "weight_decay")}}
            return OptimizerChoice(name, "DeepSpeedCPUAdagrad", torch.optim.Adagrad, kwargs, exact=False)
        return _torch(name, torch.optim.Adagrad, params)
    if lower in _REFUSED:
        raise ConfigError(f"no torch optimizer makes {name}'s update: {_REFUSED[lower]}", key="optimizer.type",
                          fix=OWN_OPTIMIZER)
    if name in _NEEDS_CLOSURE:
        raise ConfigError(f"torch.optim.{name}.step needs a closure that re-evaluates the loss, and no engine "
                          "(DeepSpeed's or zerobridge's) passes one", key="optimizer.type", fix=OWN_OPTIMIZER)
    if name in _TORCH_OPTIMIZERS:
        return _torch(name, _TORCH_OPTIMIZERS[name], params)
    names = sorted({"Adam", "AdamW", "Adagrad", *_TORCH_OPTIMIZERS} - _NEEDS_CLOSURE)
    near = next((n for n in names if n.lower() == lower), None) or closest(name, names)
    raise ConfigError(f"DeepSpeed has no optimizer {name!r}: neither one of its own nor a torch.optim class (looked "
                      "up by exact name)", key="optimizer.type",
                      fix=f"write {near!r}" if near else f"write one of {', '.join(names)}")


def _read_section(section: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(type, params)`` of an optimizer section; "auto" anywhere in params is refused."""
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ConfigError(f"expected {{\"type\": <name>, \"params\": {{...}}}}, got {section!r}", key="optimizer",
                          fix="name the optimizer in optimizer.type")
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"expected an object, got {params!r}", key="optimizer.params", fix="write params as {...}")
    refuse_auto(params, "optimizer.params")
    return section["type"], params


def refuse_auto(params: Mapping[str, Any], prefix: str) -> None:
    """A ``ConfigError`` for the first "auto" among ``params`` (or inside a list of them)."""
    for key, value in params.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(is_auto(v) for v in values):
            raise ConfigError("\"auto\" is filled by Hugging Face Trainer only; nothing fills it when zerobridge "
                              "builds the section", key=f"{prefix}.{key}",
                              fix="write the value (Trainer's default, or the one its flags would give)")


def _only(params: Mapping[str, Any], takes: frozenset[str], cls: str, also: str = "",
          known: frozenset[str] = frozenset()) -> None:
    """A ``ConfigError`` for the first param ``cls`` does not take: DeepSpeed's call would raise TypeError
    (``known``: params DeepSpeed reads itself, named when a typo comes close to one)."""
    for key in params:
        if key not in takes:
            near = closest(key, takes | known)
            raise ConfigError(f"DeepSpeed passes it to {cls}, which takes no {key} (TypeError)",
                              key=f"optimizer.params.{key}",
                              fix="remove it" + (f" (or rename it {near!r}, if that is what it means)" if near else "")
                              + also + f"; {cls} takes {', '.join(sorted(takes))}")


def _torch(name: str, cls: type[torch.optim.Optimizer], params: Mapping[str, Any]) -> OptimizerChoice:
    """A torch.optim class, built by DeepSpeed with the params as keywords: the same call."""
    _only(params, _keywords(cls), f"torch.optim.{cls.__name__}")
    return OptimizerChoice(name, f"torch.optim.{cls.__name__}", cls, dict(params))


def _keywords(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    signature = inspect.signature(cls.__init__)
    return frozenset(p.name for p in signature.parameters.values() if p.name not in ("self", "params")
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _adam(name: str, adamw: bool, params: Mapping[str, Any], offloaded: bool) -> OptimizerChoice:
    """DeepSpeed's Adam: type AdamW, or Adam with ``adam_w_mode`` (default true), decays decoupled; ``torch_adam``
    builds torch's class, else DeepSpeedCPUAdam when offloaded and FusedAdam otherwise."""
    decoupled = adamw or bool(params.get("adam_w_mode", True))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    rest = {k: v for k, v in params.items() if k not in _ADAM_POPPED}
    if params.get("torch_adam", False):
        _only(rest, _keywords(cls), f"torch.optim.{cls.__name__}", known=_ADAM_POPPED)
        return OptimizerChoice(name, f"torch.optim.{cls.__name__}", cls, rest)
    kernel = "DeepSpeedCPUAdam" if offloaded else "FusedAdam"
    mode = f"adamw_mode={decoupled}" if offloaded else f"adam_w_mode={decoupled}"
    _only(rest, _CPU_ADAM_TAKES if offloaded else _FUSED_ADAM_TAKES, kernel,
          also=", or set torch_adam: true to pass torch.optim keywords", known=_ADAM_POPPED)
    if rest.get("amsgrad", False):
        raise ConfigError(f"{kernel} refuses AMSGrad (DeepSpeed raises RuntimeError)", key="optimizer.params.amsgrad",
                          fix=f"set torch_adam: true for torch.optim.{cls.__name__}(amsgrad=True), or remove amsgrad")
    if not rest.get("bias_correction", True):
        raise ConfigError(f"{kernel} without bias correction is no torch optimizer's update (torch's Adam always "
                          "corrects the moments' bias)", key="optimizer.params.bias_correction", fix=OWN_OPTIMIZER)
    kwargs = {**_ADAM_DEFAULTS, **{k: v for k, v in rest.items() if k in _ADAM_DEFAULTS}}
    return OptimizerChoice(name, f"{kernel}({mode})", cls, kwargs, exact=False)
