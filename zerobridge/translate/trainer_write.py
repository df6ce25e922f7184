"""spec -> Hugging Face ``Trainer``: an ``fsdp_config`` JSON or a DeepSpeed JSON, and one line of flags.

    >>> from zerobridge.load import load_spec
    >>> from zerobridge.translate.trainer_write import write_trainer_fsdp
    >>> launch = write_trainer_fsdp(load_spec("zero3").value).value
    >>> launch.config["version"], launch.config["reshard_after_forward"], launch.config["auto_wrap_policy"]
    (2, True, 'TRANSFORMER_BASED_WRAP')
    >>> launch.command_line("fsdp.json")
    '--fsdp --fsdp_config fsdp.json'

``trainer-fsdp`` writes the current transformers form: ``--fsdp`` (bare) with
an ``fsdp_config`` holding ``version``, ``reshard_after_forward``,
``cpu_offload``, ``auto_wrap_policy``, ``transformer_layer_cls_to_wrap`` (a
list), ``min_num_params``, ``state_dict_type`` and ``activation_checkpointing``,
the keys ``TrainingArguments`` hands Accelerate's FSDP plugin; it is built from
the Accelerate FSDP writer's plugin, so both targets mean the same run.
``trainer-deepspeed`` writes the DeepSpeed JSON and ``--deepspeed``. Both add
the flags for what the spec states (batch, accumulation, clipping,
``--bf16``/``--fp16``; activation checkpointing as FSDP's own, in ``fsdp_config``,
or ``--activation_checkpointing``, the model's own, for DeepSpeed), the optimizer and
scheduler flags a DeepSpeed source's sections need (``trainer_form_of``), and
a Trainer source's own flags (``passthrough["trainer"]``), which win.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from zerobridge.spec import StrategySpec
from zerobridge.translate.accelerate_write import write_accelerate_fsdp
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.report import Report, Status, Translation
from zerobridge.translate.run_level import trainer_run_flags
from zerobridge.translate.trainer_args import trainer_form_of
from zerobridge.translate.trainer_flags import flag_pieces, merged_flags

__all__ = ["TrainerLaunch", "write_trainer_deepspeed", "write_trainer_fsdp"]

_RENAMES = {"fsdp_version": "version", "fsdp_reshard_after_forward": "reshard_after_forward",
            "fsdp_offload_params": "cpu_offload", "fsdp_auto_wrap_policy": "auto_wrap_policy",
            "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
            "fsdp_min_num_params": "min_num_params", "fsdp_state_dict_type": "state_dict_type",
            "fsdp_activation_checkpointing": "activation_checkpointing",
            "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading"}
"""Accelerate's ``fsdp_config`` keys -> the ``fsdp_config`` keys ``TrainingArguments`` reads (FSDP2)."""


@dataclass(frozen=True)
class TrainerLaunch:
    """A Trainer run's config file and flags."""

    config: dict[str, Any]
    """The ``fsdp_config`` or DeepSpeed JSON; empty when the run needs none (plain DDP)."""
    config_flag: str
    """``--fsdp_config`` or ``--deepspeed``: the flag that names ``config``."""
    flags: tuple[str, ...]
    """Every other flag, as command-line pieces (``--fsdp`` first when FSDP runs)."""

    def pieces(self, config_path: str | None = None) -> tuple[str, ...]:
        """The flags with the config named by ``config_path``, or given inline as JSON when None."""
        if not self.config:
            return self.flags
        where = config_path if config_path is not None else json.dumps(self.config, separators=(",", ":"))
        head = 1 if self.flags[:1] == ("--fsdp",) else 0
        return (*self.flags[:head], self.config_flag, where, *self.flags[head:])

    def command_line(self, config_path: str | None = None) -> str:
        """``pieces`` quoted for a shell, on one line."""
        return shlex.join(self.pieces(config_path))


_RUN_LEVEL = {"batch.micro_batch_size": "--per_device_train_batch_size",
              "batch.accumulation_steps": "--gradient_accumulation_steps", "batch.clip_grad_norm": "--max_grad_norm",
              "batch.global_batch_size": "--per_device_train_batch_size", "precision.param_dtype": "--bf16/--fp16"}
"""Spec fields Accelerate's YAML leaves to the script and Trainer's flags state."""
_DROPPED = frozenset({"fsdp_sync_module_states", "fsdp_use_orig_params"})
"""Accelerate keys with no FSDP2 meaning that Trainer leaves out of the plugin (nothing to report)."""


def _common_flags(spec: StrategySpec, report: Report, *, checkpoint_flag: bool) -> tuple[str, ...]:
    """Run-level flags, optimizer/scheduler flags and the source's own Trainer flags, later ones winning;
    ``checkpoint_flag``: recompute with ``--activation_checkpointing`` (the model's own, per decoder layer)."""
    own = spec.passthrough.get("trainer", {})
    carried = [piece for name, value in own.items() for piece in flag_pieces(name, value)]
    checkpointing = ["--activation_checkpointing", "true"] if checkpoint_flag else []
    for name in own:
        report.add(f"passthrough.trainer.{name}", Status.NOT_ABOUT_SHARDING, "the source's flag, written back",
                   target=f"--{name}")
    return merged_flags(trainer_run_flags(spec), trainer_form_of(spec).flags, checkpointing, carried)


def write_trainer_fsdp(spec: StrategySpec) -> Translation[TrainerLaunch]:
    """``--fsdp --fsdp_config`` for ``spec`` (transformers >= 5 forms), with the run's other flags."""
    acc = write_accelerate_fsdp(spec, fsdp_version=2)
    report = Report(source="spec", target="trainer-fsdp")
    for entry in acc.report:
        if entry.key.startswith("passthrough.trainer"):
            continue  # written back as flags below
        if entry.key in _RUN_LEVEL:
            flag = _RUN_LEVEL[entry.key]
            report.add(entry.key, Status.EXACT if entry.status is not Status.AUTO else Status.AUTO,
                       f"{flag}" if entry.status is not Status.AUTO else f"left to the script: Trainer's {flag}",
                       target=flag)
        else:
            report.add(entry.key, entry.status, entry.note, impact=entry.impact,
                       target=entry.target.replace("fsdp_config.fsdp_", "fsdp_config."))
    out = acc.value
    config: dict[str, Any] = {}
    for key, value in out.get("fsdp_config", {}).items():
        name = _RENAMES.get(key)
        if key in _DROPPED:
            continue
        if name is None:
            report.add(f"fsdp_config.{key}", Status.NOT_EXPRESSIBLE, "Trainer's fsdp_config has no such key under "
                       "FSDP2 (it hands Accelerate only the plugin keys it knows)")
        elif name == "transformer_layer_cls_to_wrap":
            config[name] = str(value).split(",")
        else:
            config[name] = value
    for key in ("parallelism_config", "fp8_config", "dynamo_config"):
        if key in out:
            report.add(key, Status.NOT_EXPRESSIBLE, f"Accelerate's {key} has no TrainingArguments flag here: "
                       "launch with accelerate launch and its config (--to accelerate-fsdp) to keep it")
    if out.get("distributed_type") != "FSDP":
        report.add("sharding", Status.EXACT, "nothing sharded: Trainer's plain data parallel (DDP), no --fsdp")
        return Translation(TrainerLaunch({}, "--fsdp_config", _common_flags(
            spec, report, checkpoint_flag=spec.checkpoint.activation_checkpointing)), report)
    flags = merged_flags(["--fsdp"], _common_flags(spec, report, checkpoint_flag=False))
    return Translation(TrainerLaunch(config, "--fsdp_config", flags), report)


def write_trainer_deepspeed(spec: StrategySpec) -> Translation[TrainerLaunch]:
    """``--deepspeed ds.json`` for ``spec``, with the flags Trainer fills the JSON's "auto" values from."""
    ds = write_deepspeed(spec)
    report = Report(source="spec", target="trainer-deepspeed")
    for entry in ds.report:
        if entry.key == "checkpoint.activation_checkpointing" and spec.checkpoint.activation_checkpointing:
            report.add(entry.key, Status.EQUIVALENT, "--activation_checkpointing: the model's own checkpointing "
                       "of each decoder layer", target="--activation_checkpointing")
        else:
            report.add(entry.key, entry.status, entry.note, target=entry.target, impact=entry.impact)
    flags = _common_flags(spec, report, checkpoint_flag=spec.checkpoint.activation_checkpointing)
    return Translation(TrainerLaunch(ds.value, "--deepspeed", flags), report)
