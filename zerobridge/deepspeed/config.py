"""A DeepSpeed config as ``deepspeed.initialize`` reads it: the spec, the run-level numbers, the sections.

    >>> from zerobridge.deepspeed.config import read_config
    >>> run = read_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    ...                    "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
    ...                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=2)
    >>> run.micro_batch, run.accumulation, run.train_batch, run.clip, run.stage
    (2, 2, 8, 1.0, 2)
    >>> run.optimizer["type"], run.scheduler, "optimizer" in run.spec.passthrough.get("deepspeed", {})
    ('AdamW', None, False)

The JSON's ``optimizer`` and ``scheduler`` sections are taken out of the spec:
``initialize`` builds them (``runtime.optimizers``, ``runtime.lr_schedules``)
the same way on every backend, so no backend builds a second one. Plain
DeepSpeed cannot read ``"auto"`` (only Hugging Face Trainer and Accelerate
fill it): neither can this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerobridge.spec import StrategySpec, is_auto
from zerobridge.translate.carried import SECTIONS
from zerobridge.translate.formats import read
from zerobridge.translate.sources import Located, parse_json, read_text

__all__ = ["RunConfig", "read_config"]



@dataclass(frozen=True)
class RunConfig:
    """What ``deepspeed.initialize`` takes from its config."""

    spec: StrategySpec
    """The partitioning spec, without the optimizer and scheduler sections."""
    source: str
    """Where the config came from (a path, or ``<dict>``)."""
    micro_batch: int
    accumulation: int
    train_batch: int
    clip: float
    """``gradient_clipping`` (0: none)."""
    stage: int
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None


def read_config(config: str | Path | dict[str, Any], *, world_size: int) -> RunConfig:
    """``config`` (a path to a DeepSpeed JSON/HJSON, or a dict) for a run on ``world_size`` ranks;
    ``ConfigError`` where DeepSpeed itself would refuse it (batch arithmetic, ``"auto"``)."""
    if isinstance(config, dict):
        located = Located(dict(config), "<dict>")
    else:
        located = parse_json(read_text(config), str(config))
    data = located.data
    if not isinstance(data, dict):
        raise located.error("expected a JSON object (a DeepSpeed config)")
    sections = {name: data.get(name) for name in SECTIONS}
    for name, value in sections.items():
        if value is not None and not isinstance(value, dict):
            raise located.error(f"{name} must be an object with a type and params", key=name)
    autos = [key for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "gradient_clipping") if is_auto(data.get(key))]
    if autos:
        raise located.error(f"{autos[0]} is \"auto\": only HF Trainer and Accelerate fill it, deepspeed.initialize "
                            "cannot", key=autos[0],
                            fix="write a number (`zerobridge convert SRC --to deepspeed --micro-batch N "
                                "--accumulation N --clip X` writes them)")
    spec = read(located, "deepspeed").value
    carried = {k: v for k, v in spec.passthrough.get("deepspeed", {}).items() if k not in SECTIONS}
    passthrough = {**spec.passthrough, "deepspeed": carried} if carried else \
        {k: v for k, v in spec.passthrough.items() if k != "deepspeed"}
    spec = spec.model_copy(update={"passthrough": passthrough})
    micro, steps, total = _batch(located, spec, world_size)
    clip = spec.batch.clip_grad_norm
    return RunConfig(spec=spec, source=located.source, micro_batch=micro, accumulation=steps, train_batch=total,
                     clip=0.0 if clip is None or is_auto(clip) else float(clip), stage=spec.sharding.stage.value,
                     optimizer=sections["optimizer"], scheduler=sections["scheduler"])


def _batch(located: Located, spec: StrategySpec, world: int) -> tuple[int, int, int]:
    """DeepSpeed's batch identity: train = micro x accumulation x world, any two given."""
    b = spec.batch
    micro = b.micro_batch_size if isinstance(b.micro_batch_size, int) else None
    steps = b.accumulation_steps if isinstance(b.accumulation_steps, int) else None
    total = b.global_batch_size if isinstance(b.global_batch_size, int) else None
    if micro is None and total is None:
        raise located.error("neither train_batch_size nor train_micro_batch_size_per_gpu is given (DeepSpeed "
                            "refuses it too)", fix="add \"train_micro_batch_size_per_gpu\": N")
    if total is not None and micro is not None and steps is None:
        steps = total // (micro * world)
    elif total is not None and micro is None:
        steps = steps or 1
        micro = total // (steps * world)
    steps = steps or 1
    assert micro is not None
    if micro < 1 or steps < 1 or (total is not None and total != micro * steps * world):
        raise located.error(f"train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
                            f"gradient_accumulation_steps {steps} x world size {world}", key="train_batch_size",
                            fix="make the three agree for this world size, or give only two of them")
    return micro, steps, micro * steps * world
