"""trainer_args against the real consumers: Trainer's flags parse, Trainer builds the optimizer and schedule the
report promises next to the ones DeepSpeed builds from the same JSON, Trainer accepts the flags with the JSON kept,
and ``code`` reproduces DeepSpeed's schedule exactly.

DeepSpeed's side is DeepSpeed's own code: its engine's ``_configure_basic_optimizer`` on a stand-in engine
(FusedAdam and DeepSpeedCPUAdam, which need compiled ops, are swapped for recorders that bind their real
signatures), and its ``lr_schedules`` classes on that optimizer, stepped as the engine steps them.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import deepspeed.ops.adam as ds_adam
import pytest
import torch
import transformers
from conftest import corpus_files
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.spec import StrategySpec
from zerobridge.translate import trainer_optimizer, trainer_schedule
from zerobridge.translate.report import Status
from zerobridge.translate.trainer_args import TRAINER_DEFAULTS, TrainerForm, trainer_form_of

STEPS = 30
"""Optimizer steps each schedule is read over when the JSON does not fix the run's length."""
_SAME = (Status.EXACT, Status.EQUIVALENT, Status.DEFAULT)
_DEEPSPEED_ADAMS = (ds_adam.FusedAdam, ds_adam.DeepSpeedCPUAdam)


class _Tiny(torch.nn.Module):
    """A weight, a bias and a LayerNorm: Trainer spares the last two from weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.config = types.SimpleNamespace(hidden_size=8)  # what Trainer's DeepSpeed "auto" bucket sizes read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return typing.cast(torch.Tensor, self.norm(self.lin(x)))


# ----------------------------------------------------------------------------- the two consumers


def _parse(flags: list[str], tmp_path: Path) -> TrainingArguments:
    argv = [*flags, "--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    return typing.cast(TrainingArguments, args)


def _steps(args: TrainingArguments) -> int:
    return args.max_steps if args.max_steps > 0 else STEPS


def _trainer(args: TrainingArguments) -> tuple[torch.optim.Optimizer, list[float]]:
    """Trainer's optimizer and the lr of each optimizer step, stepped as Trainer's loop steps them."""
    trainer = Trainer(model=_Tiny(), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=_steps(args))
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    return trainer.optimizer, _lrs(trainer.optimizer, trainer.lr_scheduler, _steps(args))


def _lrs(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return lrs


def _filled(sections: Mapping[str, Any], args: TrainingArguments, steps: int) -> dict[str, Any]:
    """The JSON as Trainer hands it to DeepSpeed (every "auto" filled); ValueError on a mismatch, as Trainer."""
    config = HfTrainerDeepSpeedConfig(dict(sections))
    try:
        config.trainer_config_process(args)
        config.trainer_config_finalize(args, _Tiny(), steps)
    finally:
        unset_hf_deepspeed_config()
    return typing.cast(dict[str, Any], config.config)


def _recorder(real: type) -> type[torch.optim.Optimizer]:
    """An optimizer class that binds its arguments to ``real``'s signature and keeps them as its defaults."""
    signature = inspect.signature(real.__init__)
    first = list(signature.parameters)[1]

    class Recorded(torch.optim.Optimizer):
        built = real

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            del values["self"]
            super().__init__(values.pop(first), values)

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            return None

    return Recorded


@pytest.fixture
def deepspeed_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds_adam, "FusedAdam", _recorder(ds_adam.FusedAdam))
    monkeypatch.setattr(ds_adam, "DeepSpeedCPUAdam", _recorder(ds_adam.DeepSpeedCPUAdam))


def _deepspeed(config: Mapping[str, Any], steps: int, *, client_lr: float,
               offloaded: bool = False) -> tuple[torch.optim.Optimizer, list[float] | None]:
    """DeepSpeed's optimizer for ``config`` (its engine's own selection) and its schedule's lrs, stepped as its
    engine steps them (None when it has no scheduler: the lr stays)."""
    params = list(_Tiny().parameters())
    section = config.get("optimizer")
    if section is None:  # the caller's optimizer: under Trainer, Trainer's default
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=client_lr, weight_decay=0.0)
    else:
        name = section["type"].lower() if section["type"].lower() in DEEPSPEED_OPTIMIZERS else section["type"]
        engine = types.SimpleNamespace(optimizer_params=lambda: section.get("params", {}), optimizer_name=lambda: name,
                                       zero_use_cpu_optimizer=lambda: offloaded, zenflow=False,
                                       bf16_optimizer_states=lambda: False, has_moe_layers=False)
        engine.get_optimizer_configuration = functools.partial(DeepSpeedEngine.get_optimizer_configuration, engine)
        optimizer = DeepSpeedEngine._configure_basic_optimizer(engine, params)
    scheduler = config.get("scheduler")
    if scheduler is None:
        return optimizer, None
    built = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler.get("params", {}))
    lrs = []
    for _ in range(steps):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        built.step()
    return optimizer, lrs


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` decays weights as AdamW does."""
    built = getattr(type(optimizer), "built", type(optimizer))
    if built in _DEEPSPEED_ADAMS:
        return bool(optimizer.defaults.get("adam_w_mode", optimizer.defaults.get("adamw_mode")))
    return built is torch.optim.AdamW


# ----------------------------------------------------------------------------- cases

_AUTO_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
OPTIMIZERS: dict[str, dict[str, Any] | None] = {
    "adamw-concrete": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                   "weight_decay": 0.0}},
    "adamw-auto": _AUTO_ADAMW,
    "adamw-absent": {"type": "AdamW", "params": {}},
    "adamw-torch-absent-decay": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "adam-default-w-mode": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "adam-l2": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.01}},
    "adam-l2-no-decay": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.0,
                                                    "torch_adam": True}},
    "adamw-ignores-w-mode": {"type": "AdamW", "params": {"lr": 2e-4, "adam_w_mode": False}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0}},
    "adagrad": {"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.001, "eps": 1e-9}},
    "rmsprop": {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True}},
    "none": None,
}
SCHEDULERS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "warmup-linear": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
    "warmup-log-default": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                          "warmup_num_steps": 10}},
    "warmup-min-lr": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_num_steps": 8,
                                                     "warmup_type": "linear"}},
    "warmup-auto": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                   "warmup_num_steps": "auto"}},
    "decay-linear": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10,
                                                         "warmup_type": "linear"}},
    "decay-log-min": {"type": "WarmupDecayLR", "params": {"total_num_steps": 25, "warmup_num_steps": 6,
                                                          "warmup_min_lr": 1e-5}},
    "decay-auto": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                       "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "cosine-linear": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10,
                                                           "warmup_type": "linear", "cos_min_ratio": 0.0}},
    "cosine-log-min": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 5,
                                                            "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}},
    "cosine-defaults": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20}},
}
PAIRS = [(o, "warmup-linear") for o in OPTIMIZERS] + [("adamw-concrete", s) for s in SCHEDULERS] + [
    ("adamw-auto", "warmup-auto"), ("adamw-auto", "decay-auto"), ("none", "decay-linear"), ("sgd", "cosine-log-min"),
    ("adamw-absent", "decay-log-min")]
PAIRS = list(dict.fromkeys(PAIRS))


def _sections(optimizer: str, scheduler: str) -> dict[str, Any]:
    found = {"optimizer": OPTIMIZERS[optimizer], "scheduler": SCHEDULERS[scheduler]}
    return {k: v for k, v in found.items() if v is not None}


def _form(sections: Mapping[str, Any], *, offloaded: bool = False) -> TrainerForm:
    offload = {"offload": {"optimizer": {"device": "cpu"}}, "sharding": {"optimizer_state": True}} if offloaded else {}
    return trainer_form_of(StrategySpec.model_validate({**offload, "passthrough": {"deepspeed": dict(sections)}}))


def _claimed_gap(note: str) -> float | None:
    found = re.search(r"at most ([0-9.e+-]+) of the peak lr", note)
    return float(found.group(1)) if found else None


# ----------------------------------------------------------------------------- 1. flags against Trainer and DeepSpeed


@pytest.mark.parametrize(("optimizer", "scheduler"), PAIRS, ids=[f"{o}+{s}" for o, s in PAIRS])
def test_flags_rebuild_deepspeeds_optimizer_and_schedule(optimizer: str, scheduler: str, tmp_path: Path,
                                                         deepspeed_ops: None) -> None:
    sections = _sections(optimizer, scheduler)
    form = _form(sections)
    # an "auto" warmup length is sized in the note at 100 steps: run it at that, over a run longer than it
    auto_warmup = (SCHEDULERS[scheduler] or {}).get("params", {}).get("warmup_num_steps") == "auto"
    args = _parse([*form.flags, *(["--warmup_steps", "100", "--max_steps", "150"] if auto_warmup else [])], tmp_path)
    steps = _steps(args)
    refused = [e for e in form.report if e.status is Status.IGNORED and "refuses the mismatch" in e.note]
    if refused:  # a JSON Trainer refuses as it stands: the flags rebuild what DeepSpeed alone runs
        with pytest.raises(ValueError, match="mismatch"):
            _filled(sections, args, steps)
        assert "auto" not in str(sections)
        filled = dict(sections)
    else:
        filled = _filled(sections, args, steps)  # Trainer accepts the flags with the JSON kept
    ds_opt, ds_lrs = _deepspeed(filled, steps, client_lr=args.learning_rate)
    tr_opt, tr_lrs = _trainer(args)
    _check_optimizer(form, ds_opt, tr_opt)
    _check_schedule(form, args, ds_lrs, tr_opt, tr_lrs, (SCHEDULERS[scheduler] or {}).get("type", ""))


def _check_optimizer(form: TrainerForm, ds_opt: torch.optim.Optimizer, tr_opt: torch.optim.Optimizer) -> None:
    report = form.report
    if report.find("optimizer") is not None:  # no section: Trainer's own optimizer in both flavors
        assert "--optim" not in form.flags
        return
    kind = report.find("optimizer.type")
    assert kind is not None
    ds_group, tr_group = ds_opt.param_groups[0], tr_opt.param_groups[0]
    if kind.status in _SAME:  # the same class or update (L2 Adam is AdamW without weight decay)
        assert _decoupled(ds_opt) == _decoupled(tr_opt) or ds_group["weight_decay"] == 0
    else:  # L2 Adam against Trainer's AdamW
        assert kind.status is Status.APPROXIMATED and not _decoupled(ds_opt) and _decoupled(tr_opt)
    lr = report.find("optimizer.params.lr")
    if lr is None or lr.status in _SAME:  # (ignored: the scheduler sets the lr, checked with the schedule)
        assert tr_group["initial_lr"] == ds_opt.defaults["lr"]
    for key in ("betas", "eps", "momentum", "dampening", "nesterov", "lr_decay", "alpha", "centered"):
        if key in ds_group and key in tr_group:
            assert tuple(ds_group[key]) == tuple(tr_group[key]) if key == "betas" else ds_group[key] == tr_group[key]
    decay = report.find("optimizer.params.weight_decay")
    assert decay is not None
    assert tr_group["weight_decay"] == ds_group["weight_decay"]
    spared = [g for g in tr_opt.param_groups if g["weight_decay"] != ds_group["weight_decay"]]
    if decay.status is Status.APPROXIMATED:
        assert spared and all(g["weight_decay"] == ds_group["weight_decay"] for g in ds_opt.param_groups)
    else:
        assert ds_group["weight_decay"] == 0 and not spared


def _check_schedule(form: TrainerForm, args: TrainingArguments, ds_lrs: list[float] | None,
                    tr_opt: torch.optim.Optimizer, tr_lrs: list[float], kind_name: str) -> None:
    report = form.report
    if ds_lrs is None:  # DeepSpeed alone keeps the lr; Trainer uses its own schedule in both flavors
        assert report.find("scheduler") is not None and "--lr_scheduler_type" not in form.flags
        assert args.lr_scheduler_type == "linear"
        return
    kind = report.find("scheduler.type")
    assert kind is not None and kind.status is Status.APPROXIMATED
    peak = float(tr_opt.param_groups[0]["initial_lr"])
    assert max(ds_lrs) <= peak * (1 + 1e-12)
    assert len(ds_lrs) == len(tr_lrs)
    # the note measures the run when its length is in the JSON (or does not matter), else the warmup
    measured = kind_name == "WarmupLR" or "--max_steps" in form.flags
    span = len(ds_lrs) if measured else max(2, int(args.warmup_steps)) + 2
    gaps = [abs(d - t) for d, t in zip(ds_lrs[:span], tr_lrs[:span])]
    assert max(gaps) > 0, "the report says approximated, but the schedules agree"
    claimed = _claimed_gap(kind.note)
    if claimed is not None:
        assert max(gaps) / peak == pytest.approx(claimed, rel=5e-3), kind.note
    if kind_name == "WarmupCosineLR":  # the decay is exactly Trainer's
        warmup = max(2, int(args.warmup_steps))
        assert ds_lrs[warmup + 1:] == tr_lrs[warmup + 1:len(ds_lrs)]


# ----------------------------------------------------------------------------- 2. code is DeepSpeed's schedule


CODE_CASES = [(o, s) for o, s in PAIRS if o not in ("none",)] + [("none", "none"), ("none", "warmup-auto")]


@pytest.mark.parametrize(("optimizer", "scheduler"), CODE_CASES, ids=[f"{o}+{s}" for o, s in CODE_CASES])
def test_code_reproduces_deepspeed_exactly(optimizer: str, scheduler: str, tmp_path: Path,
                                           deepspeed_ops: None) -> None:
    sections = _sections(optimizer, scheduler)
    form = _form(sections)
    args = _parse(list(form.flags), tmp_path)
    steps = _steps(args)
    refused = any(e.status is Status.IGNORED and "refuses the mismatch" in e.note for e in form.report)
    filled = dict(sections) if refused else _filled(sections, args, steps)
    ds_opt, ds_lrs = _deepspeed(filled, steps, client_lr=TRAINER_DEFAULTS["learning_rate"])
    namespace: dict[str, Any] = {"model": _Tiny(), "total_steps": steps}
    exec(compile(form.code, "<trainer_form.code>", "exec"), namespace)  # the code under test
    optimizer_, scheduler_ = namespace["optimizer"], namespace["scheduler"]
    lrs = _lrs(optimizer_, scheduler_, steps)
    expected = ds_lrs if ds_lrs is not None else [float(ds_opt.defaults["lr"])] * steps
    assert len(optimizer_.param_groups) == 1  # DeepSpeed decays every parameter alike
    assert max(abs(a - b) for a, b in zip(lrs, expected)) <= 1e-12 * max(expected)
    group, ds_group = optimizer_.param_groups[0], ds_opt.param_groups[0]
    assert _decoupled(optimizer_) == _decoupled(ds_opt)
    for key in ("betas", "eps", "weight_decay", "momentum", "nesterov", "lr_decay", "alpha", "centered"):
        if key in group and key in ds_group:
            assert tuple(group[key]) == tuple(ds_group[key]) if key == "betas" else group[key] == ds_group[key]


def test_code_runs_other_schedulers_exactly(deepspeed_ops: None) -> None:
    """OneCycle has no Trainer form: `code` builds DeepSpeed's class, momentum cycling included."""
    sections = {"optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999]}},
                "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.004, "cycle_max_lr": 0.015,
                                                             "cycle_first_step_size": 10, "decay_step_size": 5,
                                                             "decay_lr_rate": 0.01}}}
    form = _form(sections)
    assert form.report.find("scheduler.type").status is Status.NOT_EXPRESSIBLE  # type: ignore[union-attr]
    assert "--lr_scheduler_type" not in form.flags
    ds_opt, ds_lrs = _deepspeed(sections, STEPS, client_lr=0.0)
    namespace: dict[str, Any] = {"model": _Tiny()}
    exec(compile(form.code, "<trainer_form.code>", "exec"), namespace)
    assert _lrs(namespace["optimizer"], namespace["scheduler"], STEPS) == ds_lrs


# ----------------------------------------------------------------------------- report details


def test_what_the_report_says() -> None:
    form = _form({"optimizer": {"type": "Adam", "params": {"lr": 3e-4, "adam_w_mode": False, "weight_decay": 0.01}},
                  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})
    statuses = {e.key: e.status for e in form.report}
    assert statuses["optimizer.type"] is Status.APPROXIMATED  # L2 Adam
    assert statuses["scheduler.params.warmup_num_steps"] is Status.DEFAULT  # 1000, written
    assert statuses["scheduler.params.warmup_max_lr"] is Status.DEFAULT  # WarmupDecayLR's 0.001
    assert statuses["optimizer.params.lr"] is Status.IGNORED  # the scheduler sets the lr, 0.001
    assert statuses["scheduler.params.warmup_type"] is Status.APPROXIMATED  # log, DeepSpeed's default
    assert dict(zip(form.flags[::2], form.flags[1::2]))["--warmup_steps"] == "1000"
    assert "0.001" in form.report.find("optimizer.params.lr").note  # type: ignore[union-attr]


def test_optimizers_trainer_cannot_build() -> None:
    for name in ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion", "NAdam", "MuAdam", "Muon", "sgd"):
        form = _form({"optimizer": {"type": name, "params": {"lr": 0.01, "weight_decay": 0.01}}})
        entry = form.report.find("optimizer.type")
        assert entry is not None and entry.status is Status.NOT_EXPRESSIBLE and entry.note, name
        assert "--optim" not in form.flags and "--learning_rate" in form.flags, name
    assert "raise NotImplementedError" in _form({"optimizer": {"type": "OneBitAdam", "params": {}}}).code


def test_offload_builds_cpu_adam_and_torch_adam_changes_the_default_decay() -> None:
    fused = _form({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, offloaded=True)
    assert "DeepSpeedCPUAdam" in fused.report.find("optimizer.type").note  # type: ignore[union-attr]
    assert dict(zip(fused.flags[::2], fused.flags[1::2]))["--weight_decay"] == "0.0"
    torch_adam = _form({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    assert dict(zip(torch_adam.flags[::2], torch_adam.flags[1::2]))["--weight_decay"] == "0.01"
    assert torch_adam.report.find("optimizer.params.weight_decay").status is Status.APPROXIMATED  # type: ignore


@pytest.mark.parametrize(("params", "key"), [({"warmup_num_steps": 0}, "warmup_num_steps"),
                                             ({"warmup_num_steps": 10}, "total_num_steps"),
                                             ({"total_num_steps": 10, "warmup_max_lr": [1e-3]}, "warmup_max_lr")])
def test_configs_deepspeed_refuses_are_errors(params: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key) as caught:
        _form({"scheduler": {"type": "WarmupDecayLR", "params": params}})
    assert caught.value.fix


def test_the_tables_match_the_installed_classes() -> None:
    def defaults(fn: Any) -> dict[str, Any]:
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()}

    for cls in _DEEPSPEED_ADAMS:
        d = defaults(cls.__init__)
        assert {k: d[k] for k in ("lr", "betas", "eps")} == trainer_optimizer.ADAM_DEFAULTS and d["weight_decay"] == 0
    assert defaults(torch.optim.AdamW.__init__)["weight_decay"] == 0.01
    assert defaults(torch.optim.Adam.__init__)["weight_decay"] == 0
    for name, (optim, stated, optim_args, _) in trainer_optimizer.TORCH_FAMILIES.items():
        d = defaults(getattr(torch.optim, name).__init__)
        assert all(d[k] == v for k, v in stated.items()) and optim_args <= set(d), name
        assert optim in transformers.training_args.OptimizerNames._value2member_map_
    assert all(hasattr(torch.optim, n) for n in trainer_optimizer.TORCH_OPTIMIZERS)
    assert all(hasattr(torch.optim.lr_scheduler, n) for n in trainer_schedule.TORCH_SCHEDULERS)
    for kind, keys in trainer_schedule.WARMUP_PARAMS.items():
        d = defaults(getattr(lr_schedules, kind).__init__)
        assert keys == set(d) - {"self", "optimizer"}, kind
        assert d["warmup_num_steps"] == 1000 and d["warmup_type"] == "log", kind
    assert defaults(lr_schedules.WarmupDecayLR.__init__)["warmup_max_lr"] == trainer_schedule.DECAY_DEFAULT_PEAK
    assert defaults(lr_schedules.WarmupLR.__init__)["warmup_max_lr"] is None  # the optimizer's lr
    assert defaults(lr_schedules.WarmupCosineLR.__init__)["cos_min_ratio"] == 0.0001
    fields = {f.name: f.default for f in TrainingArguments.__dataclass_fields__.values()}
    for name in ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay"):
        assert fields[name] == TRAINER_DEFAULTS[name], name
    assert fields["warmup_steps"] == 0 and TRAINER_DEFAULTS["warmup_num_steps"] == 1  # max(1, 0)
    assert fields["optim"] == "adamw_torch_fused"  # why --optim is always written


# ----------------------------------------------------------------------------- 3. the corpus


def _keys(section: Mapping[str, Any], name: str) -> Iterator[str]:
    for key, value in section.items():
        if key == "params" and isinstance(value, Mapping):
            yield from (f"{name}.params.{k}" for k in value)
        else:
            yield f"{name}.{key}"


@pytest.mark.corpus
@pytest.mark.parametrize("path", corpus_files("deepspeed"), ids=lambda p: p.name)
def test_corpus_forms_parse_and_report_every_key(path: Path, tmp_path: Path) -> None:
    spec = load_spec(str(path)).value
    form = trainer_form_of(spec)
    args = _parse(list(form.flags), tmp_path)
    carried = spec.passthrough.get("deepspeed", {})
    for name in ("optimizer", "scheduler"):
        if name not in carried:
            assert form.report.find(name) is not None
            continue
        reported = {e.key for e in form.report}
        assert set(_keys(carried[name], name)) <= reported, name
    config = {**{k: v for k, v in carried.items() if k in ("optimizer", "scheduler")}}
    if config:
        _filled(config, args, _steps(args))  # Trainer accepts the flags with these sections kept
