"""Every supported format: how to recognise it, read it and write it.

    >>> from zerobridge.translate.formats import TARGETS, write
    >>> from zerobridge.spec import StrategySpec
    >>> sorted(TARGETS)[:3]
    ['accelerate-deepspeed', 'accelerate-fsdp', 'deepspeed']
    >>> write(StrategySpec(), "spec").value["sharding"]["optimizer_state"]
    False

Readers and writers live one module per format; this module only routes to
them by format name, through ``SOURCES`` and ``TARGETS`` (at the end of the
module, after the spec's own reader and writer, which they list too).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zerobridge.errors import ConfigError, closest
from zerobridge.spec import StrategySpec
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.accelerate_write import write_accelerate_deepspeed, write_accelerate_fsdp
from zerobridge.translate.deepspeed_buckets import BucketSizes
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.fsdp1 import read_fsdp1, write_fsdp1
from zerobridge.translate.fsdp2 import read_fsdp2, write_fsdp2
from zerobridge.translate.keys import from_validation_error
from zerobridge.translate.launch_script import ScriptLocated, parse_flags_file, parse_launch_script
from zerobridge.translate.lightning import write_lightning
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.sources import Located, note_lenient, parse_json, parse_toml, parse_yaml, read_text
from zerobridge.translate.torchtitan import read_torchtitan
from zerobridge.translate.torchtitan_write import toml_text, write_torchtitan
from zerobridge.translate.trainer_read import is_fsdp_config, read_trainer
from zerobridge.translate.trainer_write import TrainerLaunch, write_trainer_deepspeed, write_trainer_fsdp

__all__ = ["SOURCES", "TARGETS", "detect_format", "read", "read_file", "render", "write"]

Reader = Callable[[Located], Translation[StrategySpec]]
Writer = Callable[[StrategySpec], Translation[Any]]

YAML_TARGETS = frozenset({"accelerate-fsdp", "accelerate-deepspeed"})
"""Targets whose natural file form is YAML (Accelerate config files)."""

_SPEC_KEYS = frozenset(StrategySpec.model_fields)
_SCRIPT_SUFFIXES = (".sh", ".bash")
_FLAGS_SUFFIXES = (".args", ".flags", ".txt")
_TRAINER_KEYS = frozenset({"per_device_train_batch_size", "output_dir", "fsdp", "fsdp_config", "deepspeed",
                           "learning_rate", "lr_scheduler_type", "max_grad_norm", "gradient_checkpointing", "optim"})
"""``TrainingArguments`` fields no other format's top level holds."""


def detect_format(located: Located) -> str:
    """The format of parsed data, from its keys and file suffix."""
    data = located.data
    keys = set(data)
    suffix = Path(located.source).suffix.lower()
    trainer = isinstance(located, ScriptLocated) or keys & _TRAINER_KEYS - {"fsdp_config"} or is_fsdp_config(keys)
    if trainer and "distributed_type" not in keys:
        return "trainer"
    if "distributed_type" in keys or "fsdp_config" in keys or "deepspeed_config" in keys:
        return "accelerate"
    if suffix == ".toml" and ("parallelism" in keys or "training" in keys or "job" in keys):
        return "torchtitan"
    if keys and keys <= _SPEC_KEYS:
        return "spec"
    if ("sharding_strategy" in keys or "auto_wrap_policy" in keys
            or ("cpu_offload" in keys and "zero_optimization" not in keys)):
        return "fsdp1"
    if "reshard_after_forward" in keys or "mp_policy" in keys or "offload_policy" in keys:
        return "fsdp2"
    if suffix in (".json", ".hjson") or keys & {"zero_optimization", "train_batch_size", "fp16", "bf16",
                                                 "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}:
        return "deepspeed"
    raise located.error(
        "cannot tell which format this is",
        fix="pass --from deepspeed|fsdp1|fsdp2|accelerate|torchtitan|trainer|spec")


def parse_file(path: str | Path) -> Located:
    """Parse a config file by its suffix (JSON/HJSON, YAML, TOML)."""
    text = read_text(path)
    source = str(path)
    suffix = Path(path).suffix.lower()
    if suffix in (".yaml", ".yml"):
        return parse_yaml(text, source)
    if suffix == ".toml":
        return parse_toml(text, source)
    if suffix in _SCRIPT_SUFFIXES:
        return parse_launch_script(text, source)
    if suffix in _FLAGS_SUFFIXES:
        return parse_flags_file(text, source)
    if suffix in (".json", ".hjson", ".jsonc", ""):
        return parse_json(text, source)
    raise ConfigError(f"unknown file type {suffix!r}", source=source,
                      fix="use a .json/.hjson (DeepSpeed, FSDP kwargs, TrainingArguments, spec), .yaml "
                          "(Accelerate, TrainingArguments, spec), .toml (torchtitan, strategies), .sh (a launch "
                          "script) or .args/.txt (Trainer flags) file")


def read(located: Located, fmt: str | None = None) -> Translation[StrategySpec]:
    """Read parsed data in ``fmt`` (detected when None) into a spec."""
    fmt = fmt or detect_format(located)
    if fmt not in SOURCES:
        raise ConfigError(f"unknown source format {fmt!r}", fix=f"use one of: {', '.join(SOURCES)}")
    try:
        translation = SOURCES[fmt](located)
    except ConfigError as exc:
        raise exc.located(source=located.source) from None
    note_lenient(located, translation.report)
    return translation



def read_file(path: str | Path, fmt: str | None = None) -> Translation[StrategySpec]:
    """Parse and read a config file."""
    return read(parse_file(path), fmt)


def write(spec: StrategySpec, target: str, *, sizes: BucketSizes | None = None) -> Translation[Any]:
    """Write ``spec`` in the ``--to`` format ``target``; ``sizes``: DeepSpeed's buckets for the model
    it will train, where the spec leaves them to the engine (read by the ``deepspeed`` target)."""
    if target not in TARGETS:
        suggestion = closest(target, TARGETS)
        raise ConfigError(f"unknown target {target!r}",
                          fix=f"did you mean {suggestion!r}?" if suggestion else f"use one of: {', '.join(TARGETS)}")
    if target == "deepspeed":
        return write_deepspeed(spec, sizes)
    return TARGETS[target](spec)


def render(value: Any, target: str, config_path: str | None = None) -> str:
    """A written ``target`` as file text: YAML, TOML, JSON, or for the Trainer targets one line of flags
    naming the config at ``config_path`` (inline JSON when None)."""
    if isinstance(value, TrainerLaunch):
        return value.command_line(config_path) + "\n"
    if target in YAML_TARGETS:
        import yaml

        return str(yaml.safe_dump(value, sort_keys=False))
    if target == "torchtitan":
        return toml_text(value)
    return json.dumps(value, indent=2) + "\n"


def read_spec(located: Located) -> Translation[StrategySpec]:
    """Read a zerobridge spec written as JSON, YAML or TOML."""
    try:
        spec = StrategySpec.model_validate(located.data)
    except ValidationError as exc:
        error = from_validation_error(exc, source=located.source)
        first = exc.errors()[0]
        if first["type"] == "extra_forbidden":
            error = _suggest(error, [str(p) for p in first["loc"]])
        raise error.located(line=located.line_of(error.key or "")) from None
    report = Report(source="spec", target="spec")
    for key in located.data:
        report.add(key, Status.EXACT)
    return Translation(spec, report)


def _suggest(error: ConfigError, loc: list[str]) -> ConfigError:
    model: Any = StrategySpec
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        model = annotation if hasattr(annotation, "model_fields") else None
        if model is None:
            return error
    names = list(getattr(model, "model_fields", {}))
    match = closest(loc[-1], names)
    fix = f"did you mean {match!r}?" if match else f"valid keys: {', '.join(names)}"
    return ConfigError(error.message, source=error.source, key=error.key, fix=fix)


def write_spec(spec: StrategySpec) -> Translation[dict[str, Any]]:
    """The spec itself, every field stated."""
    return Translation(spec.dump(), Report(source="spec", target="spec"))


SOURCES: dict[str, Reader] = {
    "deepspeed": read_deepspeed,
    "fsdp1": read_fsdp1,
    "fsdp2": read_fsdp2,
    "accelerate": read_accelerate,
    "torchtitan": read_torchtitan,
    "trainer": read_trainer,
    "spec": read_spec,
}
"""Format name -> reader, each ``(Located) -> Translation[StrategySpec]``."""

TARGETS: dict[str, Writer] = {
    "deepspeed": write_deepspeed,
    "fsdp1": write_fsdp1,
    "fsdp2": write_fsdp2,
    "accelerate-fsdp": write_accelerate_fsdp,
    "accelerate-deepspeed": write_accelerate_deepspeed,
    "lightning": write_lightning,
    "torchtitan": write_torchtitan,
    "trainer-fsdp": write_trainer_fsdp,
    "trainer-deepspeed": write_trainer_deepspeed,
    "spec": write_spec,
}
"""``--to`` name -> writer, each ``(StrategySpec) -> Translation[dict]`` (the Trainer targets:
``Translation[TrainerLaunch]``, a config and its flags)."""
