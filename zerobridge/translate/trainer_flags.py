"""``TrainingArguments`` flags: which ones zerobridge knows, how a DeepSpeed JSON's ``"auto"`` is filled
from them, and how a list of them is merged and written.

    >>> from zerobridge.translate.trainer_flags import deepspeed_filled, merged_flags
    >>> ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    >>> deepspeed_filled(ds, {"per_device_train_batch_size": "4", "bf16": True})[0]
    {'train_micro_batch_size_per_gpu': 4, 'gradient_clipping': 1.0, 'bf16': {'enabled': True}}
    >>> merged_flags(["--bf16", "--learning_rate", "1e-5"], ["--learning_rate", "2e-5", "--tf32", "True"])
    ('--bf16', '--learning_rate', '2e-5', '--tf32', 'True')

``deepspeed_filled`` does what ``HfTrainerDeepSpeedConfig.trainer_config_process``
does with a config passed as ``--deepspeed``: every ``"auto"`` it fills from a
flag gets the flag's value, or Trainer's default when the flag is absent. The
keys it fills only once the model and step count exist (hidden-size buckets,
``total_num_steps``) and ``train_batch_size`` (it needs the world size) stay
``"auto"``, as the DeepSpeed reader reads them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from zerobridge.translate.keys import TRUTHY

__all__ = ["CARRIED_FLAGS", "DEPRECATED_FLAGS", "RENAMED_FLAGS", "deepspeed_filled", "flag_pieces", "flags_dict",
           "merged_flags"]

DEPRECATED_FLAGS = ("fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params")
"""transformers 4.x flags that 5.x refuses: read into ``fsdp_config``, never written."""

RENAMED_FLAGS = {"evaluation_strategy": "eval_strategy", "push_to_hub_token": "hub_token",
                 "warmup_ratio": "warmup_steps", "gradient_checkpointing": "activation_checkpointing",
                 "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
"""transformers 4.x flag names and the names 5.x reads: read under the new name, written so (5.x reads a
``--warmup_steps`` below 1 as the ratio ``--warmup_ratio`` gave)."""

CARRIED_FLAGS = frozenset({
    "optim", "optim_args", "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_steps", "num_train_epochs",
    "output_dir", "logging_steps", "logging_strategy", "save_strategy", "save_steps", "save_total_limit",
    "eval_strategy", "eval_steps", "per_device_eval_batch_size", "tf32", "seed", "report_to", "do_train",
    "do_eval", "dataloader_num_workers", "dataloader_prefetch_factor", "ddp_find_unused_parameters",
    "save_only_model", "include_num_input_tokens_seen", "torch_compile", "torch_compile_backend",
    "torch_compile_mode", "activation_checkpointing_kwargs", "run_name", "bf16_full_eval",
    "fp16_full_eval",
})
"""Trainer flags that are not about sharding: kept and written back as they are (the optimizer and scheduler
ones with their meaning: Trainer builds both from them)."""

_DEFAULTS: Mapping[str, Any] = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                "max_grad_norm": 1.0, "learning_rate": 5e-05, "adam_beta1": 0.9,
                                "adam_beta2": 0.999, "adam_epsilon": 1e-08, "weight_decay": 0.0}
"""Trainer's defaults, for the "auto" keys a flag fills when the flag is absent."""

_FILLS: tuple[tuple[str, str], ...] = (
    ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps"), ("gradient_clipping", "max_grad_norm"),
    ("optimizer.params.lr", "learning_rate"), ("optimizer.params.eps", "adam_epsilon"),
    ("optimizer.params.weight_decay", "weight_decay"), ("scheduler.params.warmup_max_lr", "learning_rate"),
)
_INTS = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps"})


def _flag_value(flags: Mapping[str, Any], name: str) -> Any:
    """The flag as a number; None when it is not one (``$BATCH``: the reader then names the flag)."""
    raw = flags.get(name, _DEFAULTS.get(name))
    if raw is None or isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return raw
    try:
        return int(float(raw)) if name in _INTS else float(raw)
    except ValueError:
        return None


def _on(flags: Mapping[str, Any], name: str) -> bool:
    value = flags.get(name, False)
    return value is True or str(value).lower() in TRUTHY


def deepspeed_filled(ds: Mapping[str, Any], flags: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``ds`` with the ``"auto"`` values Trainer fills from ``flags`` filled; and one ``key=value`` note each."""
    out = copy.deepcopy(dict(ds))
    notes: list[str] = []

    def fill(path: str, value: Any) -> None:
        *parents, leaf = path.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == "auto" and value is not None:
            node[leaf] = value
            notes.append(f"{path}={value}")

    for path, name in _FILLS:
        fill(path, _flag_value(flags, name))
    betas = [_flag_value(flags, "adam_beta1"), _flag_value(flags, "adam_beta2")]
    fill("optimizer.params.betas", betas if None not in betas else None)
    fill("scheduler.params.warmup_min_lr", 0)
    warmup = _flag_value(flags, "warmup_steps")
    if warmup is not None and warmup >= 1:  # below 1: a ratio of steps not known yet
        fill("scheduler.params.warmup_num_steps", int(warmup))
    fill("fp16.enabled", _on(flags, "fp16"))
    fill("bf16.enabled", _on(flags, "bf16"))
    return out, notes


def flag_pieces(name: str, value: Any) -> list[str]:
    """``--name value`` as command-line pieces; a bare flag (``True`` read from ``--fp16``) stays bare."""
    if value is True:
        return [f"--{name}"]
    if isinstance(value, bool):
        return [f"--{name}", str(value).lower()]
    if isinstance(value, (dict, list)):
        return [f"--{name}", json.dumps(value, separators=(",", ":"))]
    return [f"--{name}", str(value)]


def flags_dict(pieces: Iterable[str]) -> dict[str, list[str]]:
    """Command-line pieces grouped by flag, in order: ``{"--bf16": [], "--lr": ["1e-5"]}``."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for piece in pieces:
        if piece.startswith("--") and not piece[2:3].isdigit():
            current = out[piece] = []
        elif current is not None:
            current.append(piece)
    return out


def merged_flags(*groups: Iterable[str]) -> tuple[str, ...]:
    """Flag lists merged in order; a later group's value for a flag replaces an earlier one's in place."""
    out: dict[str, list[str]] = {}
    for group in groups:
        for flag, values in flags_dict(group).items():
            out[flag] = values
    return tuple(piece for flag, values in out.items() for piece in (flag, *values))
