"""What a target cannot carry of another flavor's settings, and how to keep it anyway.

A DeepSpeed JSON holds the run's ``optimizer`` and ``scheduler``; an Accelerate
YAML, FSDP keyword arguments or a Lightning strategy cannot. Dropping them
silently changes the run: the user's unchanged Hugging Face ``Trainer``
command then builds Trainer's own optimizer and its default linear decay. So
every writer reports each such section once, as a change to the numbers,
with the fix: the ``TrainingArguments`` flags that rebuild it
(``trainer_args.trainer_form_of``; ``zerobridge convert SRC --trainer-args``
prints them on one line) and, for a plain loop, the torch code
(``--trainer-code``). An optimizer whose values are all ``"auto"`` is what
Trainer builds from its own arguments in both flavors: equivalent, no
warning. Other passthrough settings are listed, not warned.

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.translate.report import Report
    >>> spec = StrategySpec(passthrough={"deepspeed": {
    ...     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
    ...                                               "weight_decay": "auto"}},
    ...     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}})
    >>> report = Report(source="spec", target="accelerate-fsdp")
    >>> report_carried(spec, report, own="accelerate", target="an Accelerate config", trainer=True)
    >>> [(e.key, e.status.value) for e in report.warnings]
    [('scheduler', 'not_expressible')]
    >>> "--lr_scheduler_type constant_with_warmup" in report.find("scheduler").note
    True
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import StrategySpec, is_auto
from zerobridge.translate.report import Report, Status
from zerobridge.translate.trainer_args import trainer_form_of

__all__ = ["SECTIONS", "report_carried"]

SECTIONS = ("optimizer", "scheduler")
"""DeepSpeed sections that change the numbers and that other flavors set in the training script."""

_ADAMW = frozenset({"adam", "adamw"})
_PARAMS = ("lr", "betas", "eps", "weight_decay")


def report_carried(spec: StrategySpec, report: Report, *, own: str, target: str, trainer: bool,
                   elsewhere: str = "") -> None:
    """Report ``spec``'s passthrough from formats other than ``own`` in ``report``.

    ``target`` names what is written ("an Accelerate config"); ``trainer``: whether
    the target runs under HF Trainer (Accelerate, FSDP kwargs), so its flags are the
    fix; otherwise the fix is code (``configure_optimizers``) and ``elsewhere``."""
    for fmt, carried in spec.passthrough.items():
        if fmt == own:
            continue
        rest = sorted(k for k in carried if not (fmt == "deepspeed" and k in SECTIONS))
        if rest:
            report.add(f"passthrough.{fmt}", Status.NOT_ABOUT_SHARDING,
                       f"not carried into {target}: {', '.join(rest)}" + (f"; {elsewhere}" if elsewhere else ""))
    sections = [s for s in SECTIONS if s in spec.passthrough.get("deepspeed", {}) and own != "deepspeed"]
    if not sections:
        return
    form = trainer_form_of(spec) if trainer else None
    for section in sections:
        value = spec.passthrough["deepspeed"][section]
        if form is None:
            report.add(section, Status.NOT_EXPRESSIBLE,
                       f"{target} cannot carry DeepSpeed's {section} ({_kind(value)}): build it in "
                       "configure_optimizers()" + (f"; {elsewhere}" if elsewhere else ""), target="")
            continue
        details = [e for e in form.report if e.key == section or e.key.startswith(section + ".")]
        flags = _flags(form.flags, details)
        if section == "optimizer" and _trainer_default(value):
            report.add(section, Status.EQUIVALENT, f"{_kind(value)} with every value \"auto\": HF Trainer builds "
                       "the same optimizer from its own arguments in both flavors", target="TrainingArguments")
        else:
            differs = [e.key for e in details if e.status in (Status.APPROXIMATED, Status.NOT_EXPRESSIBLE)]
            kind = next((e for e in details if e.key == f"{section}.type"), None)
            note = f"{target} cannot carry DeepSpeed's {section} ({_kind(value)}); "
            if kind is not None and kind.status is Status.NOT_EXPRESSIBLE:
                note += f"HF Trainer has no form for it: {kind.note}"
            else:
                note += f"under HF Trainer pass {' '.join(flags)}" if flags else "HF Trainer needs no flag for it"
                if differs:
                    shown = ", ".join(differs[:3]) + (f" and {len(differs) - 3} more" if len(differs) > 3 else "")
                    note += f"; Trainer's form differs at {shown} (--explain says how)"
            note += ("; `zerobridge convert SOURCE --trainer-args` prints the flags, `--trainer-code` the torch "
                     "code for a plain loop")
            report.add(section, Status.NOT_EXPRESSIBLE, note, target="TrainingArguments")
        for entry in details:
            report.add(entry.key, entry.status, entry.note, target=entry.target, impact=entry.impact)


def _kind(section: Any) -> str:
    return str(section.get("type", "no type")) if isinstance(section, dict) else repr(section)


def _trainer_default(optimizer: Any) -> bool:
    """Whether Trainer's default AdamW, filled from its arguments, is this optimizer."""
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in _ADAMW:
        return False
    params = optimizer.get("params") or {}
    return params.get("adam_w_mode", True) is not False and all(is_auto(params.get(p)) for p in _PARAMS) \
        and set(params) <= {*_PARAMS, "adam_w_mode", "torch_adam"}


def _flags(flags: tuple[str, ...], details: list[Any]) -> list[str]:
    """The flags (with their values) that the ``details`` entries target."""
    wanted = {name for e in details for name in e.target.replace("/", " ").split() if name.startswith("--")}
    out: list[str] = []
    for i, item in enumerate(flags):
        if item.startswith("--") and item in wanted:
            out.append(item)
            if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                out.append(_quoted(flags[i + 1]))
    return out


def _quoted(value: str) -> str:
    return f"'{value}'" if any(c in value for c in " {}\"'") else value
