"""A DeepSpeed ZeRO checkpoint's files: the tag directory found, every rank's files loaded without running any
pickled code, and the layouts the import does not read refused with the fix (``deepspeed_import.py``).

    >>> from pathlib import Path
    >>> from zerobridge.checkpoint.deepspeed_files import find_tag
    >>> find_tag(Path("no/such/run"), None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    zerobridge.errors.ConfigError: ...no/such/run: no such directory
      fix: pass the directory given to save_checkpoint

Nothing is unpickled but tensors, plain containers and inert stand-ins for the DeepSpeed classes the files name
(the loss scalers, fragment addresses and the stage enum): ``torch.load(weights_only=True)`` with those stand-ins
allowed, and any other global refused with the fix.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from zerobridge.errors import ConfigError

__all__ = ["CONVERT_FIX", "MODEL_STATE_KEYS", "RESAVE_FIX", "TagFiles", "find_tag", "load_file", "open_tag"]

_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_STATE_KEYS = frozenset([
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers"])
"""DeepSpeed's own keys in a model states file; a client state is merged in beside them."""
CONVERT_FIX = ("load it in DeepSpeed on a plain data-parallel ZeRO 1-3 run (a universal checkpoint lets the "
                "parallelism change), save_checkpoint, and import that")
RESAVE_FIX = "the files come from different saves or an interrupted copy: copy the whole tag directory again"


class _Inert:
    """Stand-in for a pickled DeepSpeed object: keeps its plain attributes, runs nothing."""

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)


class _ZeroStage(int):
    """Stand-in for ``ZeroStageEnum``: only its integer value."""


_STAND_INS: list[Any] = [(_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
                         (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
                         (_Inert, "deepspeed.utils.tensor_fragment.fragment_address"),
                         (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def load_file(path: Path, key: str = "module") -> dict[str, Any]:
    """``torch.load(weights_only=True)`` with the stand-ins, a dict holding ``key``; refusals become ConfigError."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            value = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)|function (\S+)|but got (\S+)", str(exc))
        name = next((g for g in found.groups() if g), "?") if found else "an object"
        raise ConfigError(f"refuses to unpickle {name}: a DeepSpeed checkpoint holds only tensors, plain values "
                          "and DeepSpeed's loss scaler, stage enum and fragment addresses", source=path,
                          fix="if it came from your client_state, save again without it; otherwise the file was "
                          "altered: restore it from a trusted copy and never load it with plain pickle") from None
    except Exception as exc:
        raise ConfigError(f"cannot read this file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                          source=path, fix="the file is damaged or not a torch.save file: re-save it") from None
    if not isinstance(value, dict) or key not in value:
        raise ConfigError(f"holds no {key!r}: not a DeepSpeed checkpoint file", source=path, key=key,
                          fix="point at a checkpoint written by engine.save_checkpoint")
    return value


def find_tag(directory: Path, tag: str | None) -> tuple[Path, str]:
    """The tag directory: ``directory/tag``, ``directory`` itself, or what ``latest`` names."""
    if not directory.is_dir():
        raise ConfigError("no such directory", source=directory, fix="pass the directory given to save_checkpoint")
    tags = sorted(p.name for p in directory.iterdir() if p.is_dir() and any(p.glob("*_states.pt")))
    hint = f"pass tag= one of {tags}" if tags else "point at the directory given to save_checkpoint"
    if tag is None and any(directory.glob("*_states.pt")):
        return directory, directory.name
    named = tag is None and (directory / "latest").is_file()
    if named:
        tag = (directory / "latest").read_text().strip()
    elif tag is None:
        universal = (directory / "latest_universal").is_file()
        raise ConfigError("a universal checkpoint (latest_universal): not supported" if universal else
                          "no 'latest' file and no tag given", source=directory, key="tag",
                          fix=CONVERT_FIX if universal else hint)
    if not (directory / str(tag)).is_dir():
        raise ConfigError(f"no checkpoint tag {tag!r} here" + (" ('latest' names it)" if named else ""),
                          source=directory, key="tag", fix=hint)
    return directory / str(tag), str(tag)


def _optim_files(tag_dir: Path) -> dict[int, Path]:
    """The optimizer file of each data-parallel rank; refuses layouts this reader does not handle."""
    names = sorted(p.name for p in tag_dir.iterdir())
    for refused, what in [
        ((tag_dir / "zero").is_dir(), "a universal checkpoint (per-parameter folders under zero/)"),
        ((tag_dir / "offloaded_tensors").is_dir(), "optimizer state offloaded to NVMe (offloaded_tensors/)"),
        (any(n.startswith("layer_") for n in names), "a pipeline-parallel checkpoint (layer_*-model_states.pt)"),
        (any(m.group(1) != "00" for n in names if (m := re.search(r"mp_rank_(\d+)", n))),
         "a tensor-parallel checkpoint (files with mp_rank other than 00)"),
        (any(n.startswith("expp_rank_") or "_expert_" in n for n in names), "a mixture-of-experts checkpoint")]:
        if refused:
            raise ConfigError(f"{what}: not supported", source=tag_dir, fix=CONVERT_FIX)
    files = {int(m.group(2)): tag_dir / n for n in names if (m := _OPTIM_FILE.match(n))}
    model = tag_dir / "mp_rank_00_model_states.pt"
    if not files and model.is_file() and load_file(model).get("optimizer") is not None:
        _stage0(model)
    if not files:
        raise ConfigError("no *_optim_states.pt files: not a ZeRO checkpoint, or saved without optimizer state",
                          source=tag_dir, fix="save with a ZeRO stage 1-3 engine that has an optimizer")
    return files


def _stage0(model: Path) -> NoReturn:
    raise ConfigError("a ZeRO stage 0 checkpoint: its 'module' is already the full model state dict and "
                      "'optimizer' the optimizer's state_dict()", source=model, key="zero_optimization.stage",
                      fix="load both with torch.load(weights_only=True) and load_state_dict; nothing to convert")


@dataclass
class TagFiles:
    """The loaded files of one tag."""

    stage: int
    world: int
    optims: list[dict[str, Any]]  # each rank's optimizer_state_dict
    optim_paths: list[Path]
    models: list[dict[str, Any]]
    model_paths: list[Path]


def open_tag(tag_dir: Path) -> TagFiles:
    """Load every rank's files, checking world size, stage and parallelism."""
    found = _optim_files(tag_dir)
    first = load_file(found[min(found)], "optimizer_state_dict")["optimizer_state_dict"]
    count = first.get("partition_count")
    counts = {int(c) for c in (count if isinstance(count, list) else [count])}
    if len(counts) != 1:
        raise ConfigError(f"param groups partitioned over different group sizes {sorted(counts)} (expert "
                          "parallelism)", source=found[min(found)], key="partition_count", fix=CONVERT_FIX)
    world = counts.pop()
    if missing := [r for r in range(world) if r not in found]:
        prefix = found[min(found)].name.split("zero_pp_rank_")[0]
        raise ConfigError(f"rank file missing for data-parallel rank {missing[0]} of {world}",
                          source=tag_dir / f"{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt",
                          key="partition_count", fix=RESAVE_FIX)
    if len(found) != world:
        raise ConfigError(f"{len(found)} rank files but partition_count says world size {world}",
                          source=found[max(found)], key="partition_count", fix=RESAVE_FIX)
    optim_paths = [found[r] for r in range(world)]
    optims = [first] + [load_file(p, "optimizer_state_dict")["optimizer_state_dict"] for p in optim_paths[1:]]
    stage = int(first.get("zero_stage", 1))  # the BF16 optimizer (ZeRO-1) writes no zero_stage
    if stage not in (1, 2, 3):
        raise ConfigError(f"unsupported ZeRO stage {stage}", source=optim_paths[0], key="zero_stage",
                          fix="only stages 1-3 are read")
    if any(int(o.get("zero_stage", stage)) != stage or o.get("partition_count") != count for o in optims):
        raise ConfigError("rank files disagree on the ZeRO stage or world size", source=tag_dir, key="zero_stage",
                          fix=RESAVE_FIX)
    model_paths = ([tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3
                   else [tag_dir / "mp_rank_00_model_states.pt"])
    if absent := [p for p in model_paths if not p.is_file()]:
        raise ConfigError("model states file missing", source=absent[0], fix=RESAVE_FIX)
    models = [load_file(p) for p in model_paths]
    head = models[0]
    if int(head.get("dp_world_size", world)) != world:
        raise ConfigError(f"dp_world_size {head['dp_world_size']} but the optimizer files say {world}",
                          source=model_paths[0], key="dp_world_size", fix=RESAVE_FIX)
    if head.get("param_shapes") is None:
        _stage0(model_paths[0])
    return TagFiles(stage, world, optims, optim_paths, models, model_paths)
