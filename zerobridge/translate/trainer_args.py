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

from zerobridge.spec import StrategySpec
from zerobridge.spec.base import Auto, is_auto
from zerobridge.translate.report import Status
from zerobridge.translate.trainer_build import TRAINER_DEFAULTS, Build, TrainerForm, as_number, lit
from zerobridge.translate.trainer_optimizer import OptimizerSection, optimizer_code, optimizer_section
from zerobridge.translate.trainer_schedule import (
    OtherScheduler,
    Warmup,
    gap_note,
    scheduler_code,
    scheduler_section,
    type_entry,
)

__all__ = ["TRAINER_DEFAULTS", "TrainerForm", "trainer_form_of"]


def _learning_rate(b: Build, opt: OptimizerSection, sched: Warmup | OtherScheduler | None) -> str:
    """Write --learning_rate (the lr Trainer's schedule peaks at), report optimizer.params.lr, and return the
    ``code`` expression of that lr."""
    peak_from_scheduler = isinstance(sched, Warmup) and sched.peak is not None
    lr: float | Auto | None = sched.peak if isinstance(sched, Warmup) and sched.peak is not None else opt.lr
    if isinstance(lr, float):
        b.flags["--learning_rate"] = lit(lr)
    family, given = opt.family, as_number(opt.params.get("lr"), "optimizer.params.lr")
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
            b.report.add(key, Status.IGNORED, f"DeepSpeed's scheduler sets the lr (peak {lit(lr)}), so this value "
                         f"never takes effect; Trainer with this JSON kept refuses the mismatch: set it to {lit(lr)} "
                         "or \"auto\"", target="--learning_rate")
        else:
            b.report.add(key, Status.EXACT, "", target="--learning_rate")
    elif family is not None and family.optim and not peak_from_scheduler and isinstance(lr, float):
        b.report.add(key, Status.DEFAULT, f"absent: {family.builds} defaults to {lit(lr)}",
                     target="--learning_rate")
    if isinstance(lr, float):
        return lit(lr)
    if is_auto(lr):
        return b.auto_var("learning_rate")
    return ""


def _code(b: Build, opt: OptimizerSection, sched: Warmup | OtherScheduler | None, lr: str) -> str:
    optimizer = optimizer_code(b, opt, lr)
    imports, scheduler, total = scheduler_code(b, sched, lr)
    what = "`model` (a torch.nn.Module)" + (" and `total_steps` (the run's optimizer steps) exist" if total
                                            else " exists")
    family = opt.family
    head = [f"# Assumes {what}.",
            "# Call scheduler.step() after every optimizer.step(), as DeepSpeed's engine does.",
            *(["import math", ""] if isinstance(sched, Warmup) else []), "import torch",
            *(family.imports if family and family.ctor else ()), *imports]
    settings = list(b.settings.values())
    return "\n".join([*head, "", *settings, *([""] if settings else []), *optimizer, *scheduler]) + "\n"



def trainer_form_of(spec: StrategySpec) -> TrainerForm:
    """The ``TrainingArguments`` flags, report and torch code that rebuild the optimizer and scheduler of the
    DeepSpeed JSON ``spec`` was read from (``spec.passthrough["deepspeed"]``)."""
    sections = spec.passthrough.get("deepspeed", {})
    b = Build()
    opt = optimizer_section(b, sections.get("optimizer"), spec.offload.optimizer.enabled)
    sched = scheduler_section(b, sections.get("scheduler"))
    lr = _learning_rate(b, opt, sched)
    if isinstance(sched, Warmup):
        type_entry(b.report, gap_note(sched, sched.peak if sched.peak is not None else opt.lr))
    return b.trainer_form(_code(b, opt, sched, lr))
