"""Hugging Face ``TrainingArguments`` flags (a launch script, a flags file, or their JSON/YAML) -> spec.

    >>> from zerobridge.translate.launch_script import parse_launch_script
    >>> from zerobridge.translate.trainer_read import read_trainer
    >>> script = '''torchrun --nproc_per_node=8 train.py --bf16 True --per_device_train_batch_size 2 \\\\
    ...   --gradient_accumulation_steps 32 --fsdp "full_shard auto_wrap" \\\\
    ...   --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer --gradient_checkpointing True \\
    ...   --lr_scheduler_type cosine
    ... '''
    >>> t = read_trainer(parse_launch_script(script, "train.sh"))
    >>> t.value.summary(), t.value.wrapping.layer_classes, t.value.checkpoint.activation_checkpointing
    ('stage 3, params reshard_after_forward, compute bf16', ('LlamaDecoderLayer',), True)
    >>> t.value.batch.micro_batch_size, t.value.batch.accumulation_steps
    (2, 32)
    >>> t.report.find("fsdp").note.split(":")[0]
    'deprecated string form, read as transformers >= 5 reads it'
    >>> t.report.find("gradient_checkpointing").note
    'deprecated name (transformers 5 refuses it), written as --activation_checkpointing'
    >>> t.value.passthrough["trainer"]["lr_scheduler_type"]
    'cosine'

What ``Trainer`` does with the flags is what the spec says. ``--fsdp`` with
``--fsdp_config`` (a path or inline JSON) becomes Accelerate's FSDP plugin
through ``TrainingArguments.fsdp_plugin_args``: transformers >= 5 defaults to
FSDP2 (``version`` 2), ``TRANSFORMER_BASED_WRAP`` and ``reshard_after_forward``;
the plugin is read here by the Accelerate reader, so both agree on its meaning.
The ``--fsdp "full_shard auto_wrap"`` string, ``fsdp_``-prefixed config keys
and ``--fsdp_transformer_layer_cls_to_wrap`` / ``--fsdp_min_num_params``
(transformers 4.x) are read as their current forms and reported deprecated.
``--deepspeed ds.json`` reads that JSON after filling its ``"auto"`` values
from the flags, as ``HfTrainerDeepSpeedConfig`` does. Run-level flags
(batch, accumulation, ``--max_grad_norm``, ``--bf16``/``--fp16``) become the
spec's batch and precision; every other flag (``--optim``, learning rate,
scheduler, warmup, and the script's own flags) is kept verbatim in
``passthrough["trainer"]`` and written back by the Trainer targets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zerobridge.spec import AUTO, StrategySpec
from zerobridge.translate.accelerate_read import read_accelerate
from zerobridge.translate.deepspeed_read import read_deepspeed
from zerobridge.translate.keys import FALSY, TRUTHY, update_spec
from zerobridge.translate.launch_script import LaunchCommand, ScriptLocated
from zerobridge.translate.report import Impact, Report, Status, Translation
from zerobridge.translate.sources import Located, parse_json, read_text
from zerobridge.translate.trainer_flags import CARRIED_FLAGS, DEPRECATED_FLAGS, RENAMED_FLAGS, deepspeed_filled

__all__ = ["FORMAT", "is_fsdp_config", "read_trainer"]

FORMAT = "trainer"
_RUN_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "bf16", "fp16",
              "activation_checkpointing")
"""Flags the spec states (``--gradient_checkpointing`` is read as its current name, ``--activation_checkpointing``)."""
_SHARDING_FLAGS = ("fsdp", "fsdp_config", "deepspeed", *DEPRECATED_FLAGS)
_PLUGIN_V1 = ("forward_prefetch", "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers")
_PLUGIN_KEYS = ("version", "cpu_offload", "auto_wrap_policy", "min_num_params", "transformer_layer_cls_to_wrap",
                "cpu_ram_efficient_loading", "state_dict_type", "activation_checkpointing", "reshard_after_forward",
                "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings", *_PLUGIN_V1)
"""The ``fsdp_config`` keys ``TrainingArguments._process_fsdp_args`` reads (FSDP1-only ones last)."""
_CONFIG_ONLY = frozenset({"transformer_layer_cls_to_wrap", "cpu_ram_efficient_loading", "activation_checkpointing",
                          "version", "min_num_params"})
"""``fsdp_config`` keys no FSDP keyword-argument file has at its top level."""
_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")


def is_fsdp_config(keys: set[str]) -> bool:
    """Whether top-level ``keys`` are a Trainer ``fsdp_config`` file on its own (what ``--fsdp_config`` names)."""
    bare = {key.removeprefix("fsdp_") for key in keys}
    return bool(keys) and bare <= set(_PLUGIN_KEYS) and bool(
        bare & _CONFIG_ONLY or any(key.startswith("fsdp_") for key in keys))


def truthy(value: Any) -> bool:
    """A flag's value as ``HfArgumentParser`` reads a bool (a bare flag is True)."""
    return value is True or str(value).lower() in TRUTHY


def _number(located: Located, name: str, kind: type) -> Any:
    value = located.data[name]
    try:
        return kind(float(value)) if kind is int and str(value).replace(".", "", 1).isdigit() else kind(value)
    except (TypeError, ValueError):
        raise located.error(f"--{name} {value!r} is not a number", key=name,
                            fix=f"give the number itself (zerobridge expands no shell variable), e.g. --{name} 1"
                            ) from None


def read_trainer(located: Located, *, base_dir: Path | None = None) -> Translation[StrategySpec]:
    """The spec ``TrainingArguments`` flags mean; ``base_dir``: where relative ``--fsdp_config`` and
    ``--deepspeed`` paths are found (default: the source's directory, where the script is run from)."""
    report = Report(source=FORMAT, target="spec")
    if isinstance(located, ScriptLocated) and located.command is not None:
        _launcher(located.command, report)
    flags = {str(k).lstrip("-").replace("-", "_"): v for k, v in located.data.items()}
    lines = dict(located.lines)
    if is_fsdp_config(set(located.data)):  # an fsdp_config file alone: the run --fsdp --fsdp_config FILE gives
        flags, lines = {"fsdp": True, "fsdp_config": dict(located.data)}, {}
        report.add("(fsdp_config file)", Status.EXACT, f"read as --fsdp --fsdp_config {located.source}",
                   target="sharding")
    for old, new in RENAMED_FLAGS.items():
        if old in flags and new not in flags:
            flags[new] = flags.pop(old)
            lines[new] = lines.get(old, 0)
            report.add(old, Status.EXACT, f"deprecated name (transformers 5 refuses it), written as --{new}",
                       target=f"passthrough.trainer.{new}")
    located = Located(flags, located.source, located.text, lines)
    base = base_dir or Path(located.source).parent
    fsdp = flags.get("fsdp")
    fsdp_on = fsdp is not None and fsdp is not False and str(fsdp).strip().lower() not in (*FALSY, "")
    if fsdp_on and flags.get("deepspeed"):
        raise located.error("--fsdp and --deepspeed together: Trainer runs one of them, and refuses both",
                            key="deepspeed", fix="drop --fsdp (and --fsdp_config) or --deepspeed")
    if truthy(flags.get("bf16", False)) and truthy(flags.get("fp16", False)):
        raise located.error("--bf16 and --fp16 together: Trainer refuses both", key="fp16", fix="keep one")
    if fsdp_on:
        spec = _read_fsdp(located, base, report)
    elif flags.get("deepspeed"):
        spec = _read_deepspeed(located, base, report)
    else:
        spec = _read_ddp(located, report)
        for name in (n for n in ("fsdp", "fsdp_config", *DEPRECATED_FLAGS) if n in flags):
            report.add(name, Status.IGNORED, "--fsdp is off: Trainer reads no FSDP setting")
        report.add("(no --fsdp or --deepspeed)", Status.EXACT, "plain data parallel (DDP): nothing sharded",
                   target="sharding")
    spec = _run_level(located, spec, report)
    carried = {name: value for name, value in flags.items() if name not in (*_RUN_FLAGS, *_SHARDING_FLAGS)}
    for name in carried:
        if report.find(name):
            continue
        if name in CARRIED_FLAGS:
            report.add(name, Status.NOT_ABOUT_SHARDING, "a Trainer flag, written back unchanged",
                       target=f"passthrough.trainer.{name}", impact=Impact.NUMBERS)
        else:
            report.add(name, Status.NOT_ABOUT_SHARDING, "ignored: not about sharding (the script's own flag, or "
                       "one zerobridge does not read); written back unchanged", target=f"passthrough.trainer.{name}")
    if carried:
        spec = update_spec(spec, {"passthrough": {**spec.passthrough, FORMAT: carried}}, source=located.source)
    return Translation(spec, report)


def _launcher(command: LaunchCommand, report: Report) -> None:
    """The launch line: what it starts, and an Accelerate config it names (which sets sharding too)."""
    world = command.world_size
    on = f" on {world} processes (the world size Trainer sees)" if world else ""
    report.add(f"({command.launcher})", Status.NOT_ABOUT_SHARDING, f"runs {command.script}{on}",
               target="sharding.world_size")
    named = [name for name in ("config_file", "use_fsdp", "use_deepspeed") if name in command.options]
    if command.launcher == "accelerate launch" and named:
        report.add(f"(accelerate launch --{named[0]})", Status.IGNORED, "the launcher's own FSDP/DeepSpeed settings "
                   "are not read here, only the script's flags: convert the Accelerate config itself as well",
                   target="sharding")


# ----------------------------------------------------------------------------------------------- FSDP


def _fsdp_config(located: Located, base: Path, report: Report) -> tuple[dict[str, Any], str]:
    """``--fsdp_config`` as a dict (path, inline JSON or a dict), ``fsdp_`` prefixes dropped; and where it came
    from, for notes."""
    given = located.data.get("fsdp_config")
    if given is None:
        return {}, ""
    if isinstance(given, dict):
        config, where = dict(given), "fsdp_config"
    elif str(given).lstrip().startswith("{"):
        config, where = dict(parse_json(str(given), f"{located.source}: --fsdp_config").data), "inline JSON"
    else:
        path = _path(located, "fsdp_config", base)
        config, where = dict(parse_json(read_text(path), str(path)).data), str(path)
    report.add("fsdp_config", Status.EXACT, f"read from {where}")
    for key in list(config):
        if key.startswith("fsdp_"):
            config[key[5:]] = config.pop(key)
            report.add(f"fsdp_config.{key}", Status.EXACT, f"deprecated prefix, read as {key[5:]} (as Trainer does)")
    return config, where


def _path(located: Located, name: str, base: Path) -> Path:
    """The file a path flag names: ``$VAR`` from the environment, as the shell would; relative to ``base``."""
    given = str(located.data[name])
    if given.startswith("$"):
        var = given[1:].strip("{}")
        if var not in os.environ:
            raise located.error(f"--{name} {given}: the path is in a shell variable that is not set here",
                                key=name, fix=f"set it as the script's caller does: {var}=path/to/config.json "
                                               "zerobridge convert ...")
        given = os.environ[var]
    path = Path(given).expanduser()
    return path if path.is_absolute() else base / path


def _read_fsdp(located: Located, base: Path, report: Report) -> StrategySpec:
    flags = located.data
    config, _ = _fsdp_config(located, base, report)
    origin = {key: f"fsdp_config.{key}" for key in config}
    for flag, key in (("fsdp_transformer_layer_cls_to_wrap", "transformer_layer_cls_to_wrap"),
                      ("fsdp_min_num_params", "min_num_params")):
        if flag in flags:
            config.setdefault(key, flags[flag])
            origin.setdefault(key, flag)
            report.add(flag, Status.EXACT, f"deprecated flag (transformers 4.x; 5.x refuses it), read as "
                       f"fsdp_config {key}", target=f"fsdp_config.{key}")
    version = int(config.get("version", 2))
    fsdp = flags["fsdp"]
    if fsdp is not True and str(fsdp).lower() not in TRUTHY:
        items = str(fsdp).split()
        for item in items:
            if item in _STRATEGIES and version == 2 and item not in ("full_shard", "shard_grad_op"):
                raise located.error(f"--fsdp {item} is FSDP1-only, and transformers >= 5 runs FSDP2 by default",
                                    key="fsdp", fix='add "version": 1 to --fsdp_config, or use full_shard')
            if item in _STRATEGIES:
                config.setdefault("reshard_after_forward", item == "full_shard" if version == 2 else item)
                origin.setdefault("reshard_after_forward", "fsdp")
            elif item == "offload":
                config.setdefault("cpu_offload", True)
                origin.setdefault("cpu_offload", "fsdp")
            elif item != "auto_wrap":
                raise located.error(f"unknown --fsdp option {item!r}", key="fsdp",
                                    fix="use full_shard, shard_grad_op, offload and auto_wrap")
        report.add("fsdp", Status.EQUIVALENT, f"deprecated string form, read as transformers >= 5 reads it: "
                   f"FSDP{version}, {' + '.join(items)} (transformers 4.x defaulted to FSDP1; the same sharding); "
                   "write --fsdp with fsdp_config", target="sharding")
    else:
        report.add("fsdp", Status.EXACT, f"FSDP{version} through Accelerate's plugin", target="sharding")
    plugin = _plugin(located, config, origin, version, report)
    mixed = _mixed(flags)
    acc = Located({"distributed_type": "FSDP", "mixed_precision": mixed, "fsdp_config": plugin}, located.source)
    read = read_accelerate(acc)
    for entry in read.report:  # the plugin's entries, under the flag or fsdp_config key each came from
        key = entry.key
        if key.startswith("fsdp_config.fsdp_"):
            name = key.removeprefix("fsdp_config.fsdp_").replace("offload_params", "cpu_offload")
            key = origin.get(name, "")
        elif key == "mixed_precision":
            key = "bf16" if mixed == "bf16" else "fp16" if mixed == "fp16" else ""
        elif entry.status in (Status.APPROXIMATED, Status.NOT_EXPRESSIBLE, Status.IGNORED):
            key = f"fsdp_plugin_args ({key})"  # what Accelerate makes of it, said once
        else:
            continue
        if key and not report.find(key):
            report.add(key, entry.status, entry.note, target=entry.target, impact=entry.impact)
    spec = read.value
    if "state_dict_type" not in config:  # Trainer's default, not the user's choice: a target may keep its own
        spec = update_spec(spec, {"checkpoint.format": AUTO}, source=located.source)
        report.add("fsdp_config.state_dict_type", Status.DEFAULT, "absent: Trainer saves FULL_STATE_DICT; left to "
                   "each target's default", target="checkpoint.format")
    return spec


def _plugin(located: Located, config: dict[str, Any], origin: dict[str, str], version: int,
            report: Report) -> dict[str, Any]:
    """Accelerate's ``fsdp_config`` for what ``fsdp_plugin_args`` holds, Trainer's defaults filled in."""
    for key in config:
        if key not in _PLUGIN_KEYS:
            report.add(origin.get(key, f"fsdp_config.{key}"), Status.IGNORED,
                       "Trainer passes no such key to Accelerate's FSDP plugin", impact=Impact.SPEED)
        elif key in _PLUGIN_V1 and version == 2:
            report.add(origin.get(key, f"fsdp_config.{key}"), Status.IGNORED,
                       "FSDP1-only: Trainer drops it under FSDP2 (version 2, the default)", impact=Impact.SPEED)
        elif key.startswith("xla") and truthy(config[key]):
            raise located.error("XLA FSDP is not ZeRO/FSDP on GPUs", key=origin.get(key, key),
                                fix="drop the xla keys")
    layers = config.get("transformer_layer_cls_to_wrap")
    plugin: dict[str, Any] = {
        "fsdp_version": version,
        "fsdp_offload_params": truthy(config.get("cpu_offload", False)),
        "fsdp_auto_wrap_policy": config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
        "fsdp_state_dict_type": config.get("state_dict_type", "FULL_STATE_DICT"),
        "fsdp_activation_checkpointing": truthy(config.get("activation_checkpointing", False)),
        "fsdp_cpu_ram_efficient_loading": truthy(config.get("cpu_ram_efficient_loading", False)),
        "fsdp_sync_module_states": True,
    }
    if layers is not None:
        plugin["fsdp_transformer_layer_cls_to_wrap"] = ",".join(layers) if isinstance(layers, list) else layers
    if int(config.get("min_num_params", 0) or 0) > 0:
        plugin["fsdp_min_num_params"] = int(config["min_num_params"])
    reshard = config.get("reshard_after_forward", True if version == 2 else "full_shard")
    if version == 2:
        plugin["fsdp_reshard_after_forward"] = truthy(reshard)
    else:
        plugin |= {"fsdp_sharding_strategy": str(reshard).upper(),
                   "fsdp_forward_prefetch": truthy(config.get("forward_prefetch", False)),
                   "fsdp_backward_prefetch": str(config.get("backward_prefetch", "NO_PREFETCH")).upper(),
                   "fsdp_use_orig_params": truthy(config.get("use_orig_params", True)),
                   "fsdp_sync_module_states": truthy(config.get("sync_module_states", True))}
    return plugin


def _mixed(flags: dict[str, Any]) -> str:
    return "bf16" if truthy(flags.get("bf16", False)) else "fp16" if truthy(flags.get("fp16", False)) else "no"


def _read_ddp(located: Located, report: Report) -> StrategySpec:
    """No --fsdp, no --deepspeed: Trainer's DDP, with Accelerate's autocast for --bf16/--fp16."""
    read = read_accelerate(Located({"distributed_type": "MULTI_GPU", "mixed_precision": _mixed(located.data)},
                                   located.source))
    for entry in read.report:
        if entry.key == "mixed_precision" and _mixed(located.data) != "no":
            report.add(_mixed(located.data), entry.status, entry.note, target=entry.target)
    return read.value


# ------------------------------------------------------------------------------------------ DeepSpeed


def _read_deepspeed(located: Located, base: Path, report: Report) -> StrategySpec:
    given = located.data["deepspeed"]
    if isinstance(given, dict) or str(given).lstrip().startswith("{"):
        data = dict(given) if isinstance(given, dict) else dict(
            parse_json(str(given), f"{located.source}: --deepspeed").data)
        where = "inline JSON"
    else:
        path = _path(located, "deepspeed", base)
        data, where = dict(parse_json(read_text(path), str(path)).data), str(path)
    filled, notes = deepspeed_filled(data, located.data)
    read = read_deepspeed(Located(filled, where))
    report.add("deepspeed", Status.EXACT, f"the DeepSpeed JSON {where}, its \"auto\" values filled from the flags "
               f"as Trainer fills them{': ' + ', '.join(notes) if notes else ''}", target="sharding")
    for entry in read.report:
        report.add(f"deepspeed:{entry.key}", entry.status, entry.note, target=entry.target, impact=entry.impact)
    return read.value


# ---------------------------------------------------------------------------------------- run level


def _run_level(located: Located, spec: StrategySpec, report: Report) -> StrategySpec:
    """The batch, clipping, precision and checkpointing flags, Trainer's defaults where a flag is absent."""
    flags = located.data
    changes: dict[str, Any] = {}
    for name, field, default in (("per_device_train_batch_size", "micro_batch_size", 8),
                                 ("gradient_accumulation_steps", "accumulation_steps", 1)):
        if name in flags:
            changes[f"batch.{field}"] = _number(located, name, int)
            report.add(name, Status.EXACT, target=f"batch.{field}")
        elif "deepspeed" not in flags:
            changes[f"batch.{field}"] = default
            report.add(name, Status.DEFAULT, f"absent: Trainer's default {default}", target=f"batch.{field}")
    if "max_grad_norm" in flags:
        norm = _number(located, "max_grad_norm", float)
        changes["batch.clip_grad_norm"] = norm if norm > 0 else None
        report.add("max_grad_norm", Status.EXACT, "" if norm > 0 else "0: no clipping", target="batch.clip_grad_norm")
    elif "deepspeed" not in flags:
        changes["batch.clip_grad_norm"] = 1.0
        report.add("max_grad_norm", Status.DEFAULT, "absent: Trainer clips at 1.0", target="batch.clip_grad_norm")
    if changes:
        changes["batch.global_batch_size"] = None  # the launcher's world size decides it
    for name in ("bf16", "fp16"):
        if name in flags and not report.find(name):
            report.add(name, Status.EXACT, "" if truthy(flags[name]) else "off", target="precision.param_dtype")
    if "activation_checkpointing" in flags:
        on = truthy(flags["activation_checkpointing"])
        if on:
            changes["checkpoint.activation_checkpointing"] = True
        report.add("activation_checkpointing", Status.EQUIVALENT if on else Status.EXACT,
                   "the model's own checkpointing (gradient_checkpointing_enable), each decoder layer recomputed: "
                   "the spec's per-unit recomputation when the units are those layers" if on else "off",
                   target="checkpoint.activation_checkpointing")
    return update_spec(spec, changes, source=located.source) if changes else spec

