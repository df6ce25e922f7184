"""Run-level keys: batch size, accumulation, clipping and precision, which follow the runtime.

A launcher config (Accelerate YAML, FSDP keyword arguments, a Lightning or
registry name) leaves these to the training script: Hugging Face ``Trainer``
fills them from ``TrainingArguments``, Accelerate from ``Accelerator(...)`` and
the loop. Such a source reads them as ``"auto"``, so a DeepSpeed JSON written
from it says ``"auto"`` as Trainer and Accelerate expect, instead of a number
Trainer then refuses (``ds gradient_clipping=0.0 vs hf max_grad_norm=1.0``).
A source that states them (a DeepSpeed JSON, torchtitan) keeps its values.

Users of plain ``deepspeed.initialize``, which cannot read ``"auto"``, state
them on the command line (``convert --micro-batch 4 --accumulation 2 --clip
1.0 --precision bf16 --world-size 8``): ``with_run_settings`` writes them into
the spec, and ``--world-size`` overrides a source written for another world
size as ``accelerate launch --num_processes`` overrides a config (warned, not
refused).

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.translate.report import Report
    >>> report = Report(source="accelerate", target="spec")
    >>> spec = leave_to_script(StrategySpec(), report, consumer="Accelerate")
    >>> spec.batch.accumulation_steps, spec.batch.clip_grad_norm
    ('auto', 'auto')
    >>> fixed = with_run_settings(spec, micro_batch=4, clip=1.0).value
    >>> fixed.batch.micro_batch_size, fixed.batch.clip_grad_norm, fixed.batch.accumulation_steps
    (4, 1.0, 'auto')
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from zerobridge.errors import ConfigError
from zerobridge.spec import AUTO, DType, StrategySpec, is_auto
from zerobridge.translate.keys import from_validation_error
from zerobridge.translate.report import Report, Status, Translation

__all__ = ["CLI_FLAGS", "RUN_LEVEL_KEYS", "TRAINER_FLAGS", "leave_to_script", "trainer_run_flags",
           "with_run_settings"]

TRAINER_FLAGS: dict[str, str] = {
    "micro_batch_size": "--per_device_train_batch_size",
    "accumulation_steps": "--gradient_accumulation_steps",
    "global_batch_size": "--per_device_train_batch_size x --gradient_accumulation_steps x world size",
    "clip_grad_norm": "--max_grad_norm",
    "param_dtype": "--bf16 / --fp16",
}
"""Where Hugging Face ``Trainer`` takes each run-level value from."""

RUN_LEVEL_KEYS: tuple[tuple[str, str], ...] = (
    ("train_micro_batch_size_per_gpu", "micro_batch_size"), ("gradient_accumulation_steps", "accumulation_steps"),
    ("train_batch_size", "global_batch_size"), ("gradient_clipping", "clip_grad_norm"),
    ("fp16.enabled, bf16.enabled", "param_dtype"),
)
"""DeepSpeed's run-level keys and the spec field each one states."""

_PARAM = "precision.param_dtype"
CLI_FLAGS: dict[str, str] = {
    "micro_batch_size": "--micro-batch", "accumulation_steps": "--accumulation",
    "global_batch_size": "--micro-batch and --world-size", "clip_grad_norm": "--clip", "param_dtype": "--precision",
}
"""The ``zerobridge convert`` flag that states each run-level value."""


def leave_to_script(spec: StrategySpec, report: Report, *, consumer: str, stated: tuple[str, ...] = (),
                    precision: bool = False) -> StrategySpec:
    """``spec`` with accumulation and clipping not in ``stated`` (and, with ``precision``, the
    compute dtype) set to ``"auto"``, and micro and global batch not in ``stated`` to ``None``
    (chosen by the data loader): the source leaves them to the training script. Earlier
    report entries for those fields give way to one ``auto`` entry each."""
    batch: dict[str, Any] = {name: AUTO for name in ("accumulation_steps", "clip_grad_norm") if name not in stated}
    batch |= {name: None for name in ("micro_batch_size", "global_batch_size") if name not in stated}
    update: dict[str, Any] = {"batch": spec.batch.model_copy(update=batch)}
    fields = [f"batch.{name}" for name in batch]
    if precision:
        scaled = spec.precision.loss_scaling.kind != "none"
        update["precision"] = spec.precision.model_copy(update={
            "param_dtype": AUTO, "reduce_dtype": AUTO, "accumulate_dtype": AUTO,
            "auto_choices": (DType.BF16, DType.FP16) if scaled else (DType.BF16,)})
        fields.append("precision.param_dtype")
    report.entries[:] = [e for e in report.entries if e.target not in fields]
    for path in fields:
        name = path.rsplit(".", 1)[-1]
        report.add(path, Status.AUTO, f"{consumer} leaves it to the training script: HF Trainer fills it from "
                                      f"{TRAINER_FLAGS[name]}; for plain deepspeed.initialize pass "
                                      f"{CLI_FLAGS[name]} to zerobridge convert", target=path)
    return StrategySpec.model_validate({**spec.model_dump(), **{k: v.model_dump() for k, v in update.items()}})


def with_run_settings(spec: StrategySpec, *, micro_batch: int | None = None, accumulation: int | None = None,
                      clip: float | None = None, precision: str | None = None,
                      world_size: int | None = None) -> Translation[StrategySpec]:
    """``spec`` with run-level values stated on the command line; the report
    says what each replaced. A ``world_size`` other than the source's own is
    an override (warned): the global batch follows micro x accumulation."""
    report = Report(source="command line", target="spec")
    data = spec.model_dump()
    batch = data["batch"]
    for name, value, flag in (("micro_batch_size", micro_batch, "--micro-batch"),
                              ("accumulation_steps", accumulation, "--accumulation")):
        if value is not None:
            _replace(report, batch, name, value, flag)
    if clip is not None:
        if clip < 0:
            raise ConfigError(f"--clip {clip}: a gradient norm bound is >= 0", key="--clip",
                              fix="pass --clip 0 for no clipping, or a positive bound like 1.0")
        _replace(report, batch, "clip_grad_norm", clip or None, "--clip")
    if precision is not None:
        _precision(report, data["precision"], spec, DType(precision))
    if world_size is not None:
        _world(report, data, spec, world_size)
    try:
        return Translation(StrategySpec.model_validate(data), report)
    except ValidationError as exc:
        error = from_validation_error(exc)
        batch = (error.key or "batch").startswith("batch")
        fix = error.fix or ("pass values that satisfy global = micro x accumulation x world size" if batch else
                            f"pass a --world-size that fits the source's {error.key}, or change {error.key} there")
        raise ConfigError(error.message, key="--world-size" if world_size is not None else error.key,
                          fix=fix) from None


def _replace(report: Report, batch: dict[str, Any], name: str, value: Any, flag: str) -> None:
    old = batch[name]
    batch[name] = value
    if is_auto(old) or old is None:
        report.add(f"batch.{name}", Status.EXACT, f"{flag} {value}", target=f"batch.{name}")
    elif old != value:
        report.add(f"batch.{name}", Status.OVERRIDDEN, f"{flag} {value} replaces the source's {old}",
                   target=f"batch.{name}")
    if name in ("micro_batch_size", "accumulation_steps") and isinstance(batch["global_batch_size"], int):
        micro, steps = batch["micro_batch_size"], batch["accumulation_steps"]
        world = batch["global_batch_size"] // (micro * steps) if isinstance(micro, int) and isinstance(steps, int) \
            else None
        batch["global_batch_size"] = AUTO if world is None else batch["global_batch_size"]
    elif name == "micro_batch_size" and is_auto(batch["global_batch_size"]):
        batch["global_batch_size"] = None


def _precision(report: Report, precision: dict[str, Any], spec: StrategySpec, dtype: DType) -> None:
    """``--precision``: the compute dtype, and what the source derived from its own (loss scaling,
    reduce, accumulation and buffer dtypes, master weights) follows it."""
    p, old = spec.precision, spec.precision.param_dtype
    if not is_auto(old) and old != dtype:
        report.add(_PARAM, Status.OVERRIDDEN, f"--precision {dtype.value} replaces the source's {DType(old).value}",
                   target=_PARAM)
    else:
        report.add(_PARAM, Status.EXACT, f"--precision {dtype.value}", target=_PARAM)
    precision["param_dtype"] = dtype
    if dtype is not DType.FP16 and p.loss_scaling.kind != "none":
        precision["loss_scaling"] = {"kind": "none"}
        if not is_auto(old):
            report.add("precision.loss_scaling", Status.OVERRIDDEN, f"dropped with --precision {dtype.value}: "
                       "only fp16 scales the loss", target="precision.loss_scaling")
    if dtype is DType.FP32:
        precision["skip_nonfinite_steps"] = False  # skipping non-finite steps is a 16-bit rule
        precision["master_dtype"] = DType.FP32
    elif p.master_dtype not in (DType.FP32, dtype):
        precision["master_dtype"] = DType.FP32
    derived = (old,) if not is_auto(old) else ()
    for name in ("reduce_dtype", "accumulate_dtype"):
        value = getattr(p, name)
        if is_auto(value) or value in derived:
            precision[name] = DType.FP32 if dtype is DType.FP16 and name == "accumulate_dtype" else \
                dtype if dtype is DType.FP16 else AUTO
            if not is_auto(value) and value != dtype:
                report.add(f"precision.{name}", Status.OVERRIDDEN, f"{DType(value).value} followed the source's "
                           f"compute dtype; now {dtype.value}'s", target=f"precision.{name}")
    if p.buffer_dtype is not None and p.buffer_dtype in derived:
        precision["buffer_dtype"] = None if dtype is DType.FP32 else dtype


def _world(report: Report, data: dict[str, Any], spec: StrategySpec, world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: need at least one rank", key="--world-size")
    fixed = spec.sharding.world_size
    data["sharding"]["world_size"] = world_size
    batch = data["batch"]
    micro, steps, total = batch["micro_batch_size"], batch["accumulation_steps"], batch["global_batch_size"]
    if fixed is None or fixed == world_size:
        report.add("sharding.world_size", Status.EXACT, f"--world-size {world_size}", target="sharding.world_size")
        return
    note = f"--world-size {world_size} replaces the source's {fixed}, as a launcher's process count overrides a config"
    if isinstance(total, int) and isinstance(micro, int) and isinstance(steps, int):
        batch["global_batch_size"] = micro * steps * world_size
        note += f"; global batch {total} -> {micro * steps * world_size} (micro {micro} x accumulation {steps} kept)"
    elif isinstance(total, int) and isinstance(micro, int):
        if total % (micro * world_size):
            raise ConfigError(f"--world-size {world_size}: the source's global batch {total} is not a multiple of "
                              f"micro batch {micro} x {world_size} ranks", key="--world-size",
                              fix="pass --micro-batch or --accumulation as well, or another --world-size")
        note += f"; accumulation becomes {total // (micro * world_size)} to keep the global batch {total}"
    report.add("sharding.world_size", Status.OVERRIDDEN, note, target="sharding.world_size")


def trainer_run_flags(spec: StrategySpec) -> tuple[str, ...]:
    """The ``TrainingArguments`` flags for the run-level values ``spec`` states (none for
    ``"auto"``): what Trainer's check of a DeepSpeed config compares them with. A global batch
    with a known world size gives the micro batch or accumulation it implies."""
    b, dtype, world = spec.batch, spec.precision.param_dtype, spec.sharding.world_size
    micro, steps, total = b.micro_batch_size, b.accumulation_steps, b.global_batch_size
    if isinstance(total, int) and world is not None:  # the global batch implies the missing factor
        if isinstance(micro, int) and not isinstance(steps, int):
            steps = total // (micro * world)
        elif isinstance(steps, int) and not isinstance(micro, int):
            micro = total // (steps * world)
    flags: list[str] = []
    if isinstance(micro, int):
        flags += ["--per_device_train_batch_size", str(micro)]
    if isinstance(steps, int):
        flags += ["--gradient_accumulation_steps", str(steps)]
    if b.clip_grad_norm is None:
        flags += ["--max_grad_norm", "0"]  # Trainer clips only above 0
    elif not is_auto(b.clip_grad_norm):
        flags += ["--max_grad_norm", repr(float(b.clip_grad_norm))]
    if dtype == DType.BF16:
        flags.append("--bf16")
    elif dtype == DType.FP16:
        flags.append("--fp16")
    return tuple(flags)
