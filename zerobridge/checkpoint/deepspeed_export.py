"""Write a zerobridge checkpoint as a DeepSpeed ZeRO checkpoint (stages 1-3) that DeepSpeed's
``engine.load_checkpoint`` resumes from: weights, Adam state, LR scheduler state, client state and counters.

    >>> from zerobridge.checkpoint.deepspeed_export import export_deepspeed_checkpoint   # doctest: +SKIP
    >>> path, report = export_deepspeed_checkpoint("ckpt/step-100", "runs/ds", stage=2, world_size=8,
    ...                                            config="ds.json")                   # doctest: +SKIP
    >>> print(report.render())                                                         # doctest: +SKIP
    >>> export_deepspeed_checkpoint("no/such/ckpt", "runs/ds", stage=2, world_size=8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    zerobridge.checkpoint.storage.CheckpointError: ...no/such/ckpt: no such checkpoint
      fix: check the path; a save writes a directory there

The source is any zerobridge checkpoint (any stage, world size, backend), read whole in this process. The
files are DeepSpeed's natural layout for the target stage and data-parallel world size, as DeepSpeed's own
``save_checkpoint`` would have written them for the run the config describes, so DeepSpeed loads them on
its plain path: each rank reads its own optimizer file, ``load_from_fp32_weights`` copies its fp32
partition, and the base optimizer's ``load_state_dict`` takes the state and hyperparameters. (DeepSpeed's
other paths do not help: it refuses any checkpoint whose ``dp_world_size`` differs from the run's before
looking at the optimizer files, elastic re-partitioning exists only at stages 1-2 and only within the
same world size, and ZeRO-3 refuses ``elastic_checkpoint`` outright.) DeepSpeed is never imported: the
files are ``torch.save`` of plain dicts; the three DeepSpeed objects in them (the loss scaler, the stage
enum, fragment addresses) are written under DeepSpeed's class names by a pickler that only emits their
names (``deepspeed_pickle.py``), which DeepSpeed's own ``torch.load`` resolves. What of the DeepSpeed JSON
decides the layout, and what the export refuses, is ``deepspeed_target.py``.

[Note: the layout written] (DeepSpeed 0.19.8; W the world size, ``tag`` the tag directory). ``latest``
names the tag. Stages 1-2: ``mp_rank_00_model_states.pt`` holds ``module`` (every parameter, tied alias and
buffer, full), ``param_shapes`` (name -> size per param group, in flat order), ``shared_params``
(alias -> owner), ``buffer_names``, stage 2 also ``frozen_param_shapes`` / ``frozen_param_fragments``
(whole), ``lr_scheduler``, the counters, ``dp_world_size``, ``ds_config``, ``ds_version`` and the client
state's keys at the top level. Per group, the trainable parameters (round-robin order with
``round_robin_gradients``) lie end to end, each but the last padded to ``16 / element size`` elements with
``parameter_alignment``, the whole zero-padded to a multiple of 2W and cut in W equal parts P;
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds ``single_partition_of_fp32_groups`` (rank r's part
without its end padding, ``group_paddings``), ``base_optimizer_state`` (the base optimizer's
``state_dict()``: per group one flat parameter with ``exp_avg`` / ``exp_avg_sq`` of P elements and ``step``,
and the group's hyperparameters), ``param_alignment_paddings`` (DeepSpeed compares them with its own and
refuses a layout that differs: the count of trainable parameters per group is checked there),
``partition_count``, ``param_slice_mappings`` and the static loss scaler. Stage 3: one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (``module`` with empty placeholders for
parameters and full buffers, ``frozen_param_fragments`` rank r's piece of each frozen parameter,
``shared_params`` filled in rank 0's file only, as DeepSpeed finds ties on rank 0);
the trainable parameters of a group are cut in sub-groups of ``sub_group_size`` elements per rank; rank r's
``fp32_flat_groups[k]`` holds, per parameter of sub-group k, elements ``[r * c, (r + 1) * c)`` of the
flattened parameter (c = ceil(numel / W), zero-padded), and the inner ``optimizer_state_dict`` one flat
parameter (state of the same layout) per sub-group.
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerobridge.checkpoint.deepspeed_files import MODEL_STATE_KEYS
from zerobridge.checkpoint.deepspeed_pickle import FragmentAddress, LossScaler, ZeroStage, save
from zerobridge.checkpoint.deepspeed_source import SortedSource, open_source, sort_source
from zerobridge.checkpoint.deepspeed_target import DeepSpeedTarget, read_target
from zerobridge.checkpoint.layout import ZB
from zerobridge.checkpoint.storage import (
    MANIFEST,
    CheckpointError,
    atomic_write_file,
    recover,
    saving_dir,
    swap_into_place,
)
from zerobridge.translate.report import Report, Status

__all__ = ["DEEPSPEED_VERSION", "export_deepspeed_checkpoint"]

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose layout is written (``ds_version`` in the files)."""


# ---------------------------------------------------------------------------- the files

def _fp32(value: torch.Tensor) -> torch.Tensor:
    """A model value as an fp32 DeepSpeed run holds it: floating tensors in float32 (exact from 16 bits)."""
    return value.float() if value.is_floating_point() else value


def _flat(value: torch.Tensor) -> torch.Tensor:
    return value.detach().reshape(-1).float()


def _hyper(group: dict[str, Any], target: DeepSpeedTarget, index: int, where: str) -> dict[str, Any]:
    """A param group as the target optimizer keeps it (its ``load_state_dict`` takes these as they are)."""
    decoupled = group.get("decoupled_weight_decay")
    if (target.adam_w_mode is not None and isinstance(decoupled, bool) and decoupled != target.adam_w_mode
            and float(group["weight_decay"]) != 0.0):
        theirs, ours = ("AdamW", "Adam (L2)") if target.adam_w_mode else ("Adam (L2)", "AdamW")
        raise CheckpointError(f"param group {index} ran {ours} weight decay but the JSON asks for {theirs}",
                              source=target.source or where, key="optimizer.type",
                              fix="set the JSON's optimizer type (or adam_w_mode) to what the source ran")
    if target.optimizer == "torch":  # torch's groups as saved; a JSON schedule is DeepSpeed's, which sets no initial_lr
        return {k: v for k, v in group.items() if k != "params" and not (k == "initial_lr" and target.scheduler)}
    return {"lr": group["lr"], "bias_correction": True, "betas": list(group["betas"]), "eps": group["eps"],
            "weight_decay": group["weight_decay"], "step": 0}


def _step_value(step: torch.Tensor, target: DeepSpeedTarget) -> int | torch.Tensor:
    """FusedAdam counts in a Python int, torch's Adam in a 0-d tensor."""
    return int(step.item()) if target.optimizer == "fused_adam" else step.clone()


@dataclass
class _Files:
    """What is written: file name -> the dict ``torch.save`` writes."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_shapes: list[OrderedDict[str, torch.Size]] = field(default_factory=list)


def _stage12(src: SortedSource, target: DeepSpeedTarget, out: _Files) -> None:
    """Stages 1-2 (DeepSpeedZeroOptimizer): one flat buffer per param group, cut in W equal parts."""
    world, state = target.world_size, src.state
    element = 16 // math.gcd(16, 4) if target.parameter_alignment else 1  # fp32: 4 bytes an element
    ranks: list[dict[str, Any]] = [{"partitions": [], "states": [], "groups": [], "paddings": [], "maps": []}
                                   for _ in range(world)]
    alignments = []
    for g, names in enumerate(src.groups):
        if not names:
            raise CheckpointError(f"param group {g} has no trainable parameter with optimizer state; DeepSpeed's "
                                  "ZeRO 1-2 optimizer cannot build such a group", source=src.path,
                                  key=f"optim.param_groups.{g}",
                                  fix="drop the empty group from the DeepSpeed run's optimizer and the source's")
        order = [n for j in range(world) for n in names[j::world]] if target.round_robin else list(names)
        paddings, offsets, offset = [], {}, 0
        for index, name in enumerate(order):
            offsets[name] = offset
            offset += state.model[name].numel()
            pad = 0 if index == len(order) - 1 else (-offset) % element
            paddings.append(pad)
            offset += pad
        used = offset
        # param_slice_mappings (read by DeepSpeed's universal-checkpoint tools, not by load_checkpoint) as DeepSpeed
        # 0.19.8 computes them: at the flat offsets only when some parameter is padded, else at running offsets in
        # the group's own order, even when round_robin_gradients reordered the flat buffer.
        at = offsets if any(paddings) else dict(zip(names, itertools.accumulate(
            (state.model[n].numel() for n in names), initial=0)))
        length = math.ceil(used / (2 * world)) * 2 * world
        size = length // world
        buffers = {key: torch.zeros(length) for key in ("fp32", "exp_avg", "exp_avg_sq")}
        for name in order:
            start, numel = offsets[name], state.model[name].numel()
            buffers["fp32"][start:start + numel] = _flat(state.model[name])
            for key in ("exp_avg", "exp_avg_sq"):
                buffers[key][start:start + numel] = _flat(state.optimizer[name][key])
        out.param_shapes.append(OrderedDict((n, torch.Size(state.model[n].shape)) for n in order))
        alignments.append(paddings)
        for r, rank in enumerate(ranks):
            lo = r * size
            pad = size if used <= lo else lo + size - used if used < lo + size else 0
            rank["partitions"].append(buffers["fp32"][lo:lo + size - pad].clone())
            rank["states"].append({"step": _step_value(src.step, target),
                                   "exp_avg": buffers["exp_avg"][lo:lo + size].clone(),
                                   "exp_avg_sq": buffers["exp_avg_sq"][lo:lo + size].clone()})
            rank["groups"].append(_hyper(state.param_groups[g], target, g, str(src.path)) | {"params": [g]})
            rank["paddings"].append(pad)
            rank["maps"].append(OrderedDict(
                (n, FragmentAddress(min(at[n] + state.model[n].numel(), lo + size) - max(at[n], lo),
                                     max(at[n], lo) - lo))
                for n in names if at[n] < lo + size and lo < at[n] + state.model[n].numel()))
    for r, rank in enumerate(ranks):
        optimizer: dict[str, Any] = {"loss_scaler": LossScaler(), "dynamic_loss_scale": False, "overflow": False}
        if target.clip_grad is not None:
            optimizer["clip_grad"] = target.clip_grad
        optimizer |= {
            "base_optimizer_state": {"state": dict(enumerate(rank["states"])), "param_groups": rank["groups"]},
            "single_partition_of_fp32_groups": rank["partitions"],
            "zero_stage": ZeroStage(target.stage), "group_paddings": rank["paddings"],
            "param_alignment_paddings": alignments, "partition_count": [world] * len(src.groups),
            "ds_version": DEEPSPEED_VERSION, "param_slice_mappings": rank["maps"]}
        out.files[f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = _optim_file(optimizer, target)


def _piece(value: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 piece of ``value``: ceil(numel / W) elements of it flattened, zero-padded."""
    size = math.ceil(value.numel() / world)
    flat = value.detach().reshape(-1)
    piece = flat[rank * size:(rank + 1) * size]
    if piece.numel() < size:
        piece = torch.cat([piece, torch.zeros(size - piece.numel(), dtype=flat.dtype)])
    return piece.clone()


def _stage3(src: SortedSource, target: DeepSpeedTarget, out: _Files) -> None:
    """Stage 3 (DeepSpeedZeroOptimizer_Stage3): every parameter cut in W pieces, grouped in sub-groups."""
    world, state = target.world_size, src.state
    subgroups: list[list[str]] = []
    owner: list[int] = []
    for g, names in enumerate(src.groups):
        size = sum(math.ceil(state.model[n].numel() / world) for n in names)
        if not names:
            continue
        if target.sub_group_size >= size:
            subgroups.append(list(names))
            owner.append(g)
            continue
        current: list[str] = []
        count = 0
        for index, name in enumerate(names):
            current.append(name)
            count += math.ceil(state.model[name].numel() / world)
            if count >= target.sub_group_size or index == len(names) - 1:
                subgroups.append(current)
                owner.append(g)
                current, count = [], 0
    out.param_shapes = [OrderedDict((n, torch.Size(state.model[n].shape)) for n in sub) for sub in subgroups]
    for r in range(world):
        flats = [torch.cat([_piece(_flat(state.model[n]), r, world) for n in sub]) for sub in subgroups]
        states = {k: {"step": _step_value(src.step, target),
                      **{key: torch.cat([_piece(_flat(state.optimizer[n][key]), r, world) for n in sub])
                         for key in ("exp_avg", "exp_avg_sq")}} for k, sub in enumerate(subgroups)}
        groups = [_hyper(group, target, g, str(src.path)) | {"params": [k for k, o in enumerate(owner) if o == g]}
                  for g, group in enumerate(state.param_groups)]
        optimizer = {"zero_stage": ZeroStage(3), "loss_scaler": LossScaler(), "dynamic_loss_scale": False,
                     "overflow": False, "partition_count": world,
                     "optimizer_state_dict": {"state": states, "param_groups": groups}, "fp32_flat_groups": flats}
        out.files[f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = _optim_file(optimizer, target)


def _optim_file(optimizer: dict[str, Any], target: DeepSpeedTarget) -> dict[str, Any]:
    return {"optimizer_state_dict": optimizer, "ds_config": target.config, "ds_version": DEEPSPEED_VERSION}


def _scheduler(src: SortedSource, target: DeepSpeedTarget) -> dict[str, Any] | None:
    """The scheduler state in the form the DeepSpeed run's scheduler takes."""
    saved = src.state.scheduler
    if saved is None or not target.scheduler:
        return saved
    if isinstance(saved.get("last_batch_iteration"), int):
        return {"last_batch_iteration": int(saved["last_batch_iteration"])}
    if isinstance(saved.get("last_epoch"), int):  # a torch scheduler counts steps from 0, DeepSpeed's from -1
        return {"last_batch_iteration": int(saved["last_epoch"]) - 1}
    raise CheckpointError(f"holds scheduler state with keys {sorted(map(str, saved))}, which has no position "
                          "DeepSpeed's schedules take (last_batch_iteration or last_epoch)", source=src.path,
                          key=f"{ZB}.scheduler", fix="drop the JSON's scheduler section and pass the scheduler "
                          "the source ran to deepspeed.initialize(lr_scheduler=...)")


def _counters(src: SortedSource) -> dict[str, int]:
    """``global_steps``, ``global_samples`` (when known) and ``skipped_steps``: the ones ``zerobridge.deepspeed``
    saved, else an imported checkpoint's, else the optimizer's step count."""
    meta = src.state.metadata
    found = meta.get("deepspeed")
    saved: dict[str, Any] = found if isinstance(found, dict) else {}
    skipped = saved.get("skipped_steps", meta.get("skipped_steps", src.skipped))
    skipped = int(skipped) if isinstance(skipped, int) else src.skipped
    steps = saved.get("global_steps", meta.get("global_step"))
    if not isinstance(steps, int):
        steps = int(src.step.item()) + skipped
    counters = {"global_steps": int(steps), "skipped_steps": skipped}
    samples = saved.get("global_samples", meta.get("global_samples"))
    if isinstance(samples, int):
        counters["global_samples"] = samples  # else DeepSpeed takes global_steps x train_batch_size
    return counters


def _model_files(src: SortedSource, target: DeepSpeedTarget, out: _Files, counters: dict[str, int],
                 scheduler: dict[str, Any] | None, client: dict[str, Any]) -> None:
    """The model states file (stages 1-2) or one per rank (stage 3)."""
    state, world, stage = src.state, target.world_size, target.stage
    params = {n for group in src.groups for n in group} | set(src.frozen) | set(src.shared)
    values = {n: _fp32(state.model[src.shared.get(n, n)]) for n in state.model}  # tied: the owner's tensor
    for r in range(world if stage == 3 else 1):
        module = OrderedDict((n, torch.empty(0, dtype=v.dtype) if stage == 3 and n in params else v)  # stage 3:
                             for n, v in values.items())  # parameters live in the partitions
        fragments: OrderedDict[str, torch.Tensor] | None = None
        if stage == 3:
            fragments = OrderedDict((n, _piece(values[n], r, world)) for n in src.frozen)
        elif stage == 2:
            fragments = OrderedDict((n, values[n]) for n in src.frozen)
        head: dict[str, Any] = {
            "module": module, "buffer_names": list(src.buffers), "optimizer": None,
            "param_shapes": out.param_shapes,
            "frozen_param_shapes": None if fragments is None else OrderedDict(
                (n, torch.Size(state.model[n].shape)) for n in src.frozen),
            "shared_params": dict(src.shared) if r == 0 else {},  # DeepSpeed finds ties on rank 0 only
            "frozen_param_fragments": fragments, "lr_scheduler": scheduler,
            "data_sampler": None, "random_ltd": None, "skipped_steps": counters["skipped_steps"],
            "global_steps": counters["global_steps"]}
        if "global_samples" in counters:
            head["global_samples"] = counters["global_samples"]
        head |= {"dp_world_size": world, "mp_world_size": 1,
                 "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                 "ds_config": target.config, "ds_version": DEEPSPEED_VERSION}
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        out.files[name] = head | client


def _client_state(src: SortedSource) -> dict[str, Any]:
    client = src.state.client_state or {}
    if clash := sorted(set(map(str, client)) & MODEL_STATE_KEYS):
        raise CheckpointError(f"client_state holds {clash}, key(s) DeepSpeed's model states file keeps its own "
                              "values under (the client state is merged in beside them)", source=src.path,
                              key=f"{ZB}.client_state", fix="rename those client_state keys and save again")
    return dict(client)


# ---------------------------------------------------------------------------- writing

def _write(destination: Path, tag: str, files: dict[str, dict[str, Any]]) -> Path:
    """Write ``files`` into ``destination/tag`` (staged beside it, swapped in), then ``latest``."""
    if (destination / MANIFEST).is_file():
        raise CheckpointError("is a zerobridge checkpoint, not a directory to write a DeepSpeed one into",
                              source=destination, fix="pass another output directory")
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise CheckpointError(f"tag {tag!r} is not a directory name", key="tag", fix="pass a plain name")
    target = destination / tag
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not any(target.glob("*_states.pt")))):
        raise CheckpointError("exists and is not a DeepSpeed checkpoint tag directory", source=target, key="tag",
                              fix="remove it, or pass another --tag or output directory")
    destination.mkdir(parents=True, exist_ok=True)
    recover(target)
    staged = saving_dir(target)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    try:
        for name, obj in files.items():
            save(obj, staged / name)
        swap_into_place(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    atomic_write_file(destination / "latest", lambda tmp: tmp.write_text(tag, encoding="utf-8"))
    return target


def export_deepspeed_checkpoint(source: str | Path, destination: str | Path, *, stage: int, world_size: int,
                                tag: str | None = None, config: str | Path | dict[str, Any] | None = None,
                                frozen: Iterable[str] = ()) -> tuple[Path, Report]:
    """Write the zerobridge checkpoint ``source`` into ``destination/tag`` (default ``global_step<N>``) as
    DeepSpeed's ``save_checkpoint`` would for a ZeRO-``stage`` run of ``world_size`` ranks with ``config``,
    and name the tag in ``destination/latest``; return the tag directory and a report.

    ``frozen``: parameters (requires_grad=False) the source's optimizer groups did not list, so they are not
    taken for buffers (at stage 3 DeepSpeed keeps a piece of each on every rank). Parameters a group lists
    without optimizer state are taken for frozen ones; a model entry equal to a listed parameter (same
    shape, dtype and values) for a tied alias; any other entry for a buffer."""
    target = read_target(stage, world_size, config)
    src = sort_source(open_source(Path(source)), frozen)
    client = _client_state(src)
    scheduler = _scheduler(src, target)
    counters = _counters(src)
    out = _Files()
    (_stage3 if target.stage == 3 else _stage12)(src, target, out)
    _model_files(src, target, out, counters, scheduler, client)
    tag = str(tag) if tag is not None else f"global_step{counters['global_steps']}"
    path = _write(Path(destination), tag, out.files)
    return path, _report(src, target, path, counters, scheduler, client)


def _report(src: SortedSource, target: DeepSpeedTarget, path: Path, counters: dict[str, int],
            scheduler: dict[str, Any] | None, client: dict[str, Any]) -> Report:
    report = Report("zerobridge checkpoint", f"deepspeed ZeRO-{target.stage}, world size {target.world_size}")
    optimizer = {"fused_adam": "FusedAdam (the JSON's Adam/AdamW)", "torch": "torch Adam/AdamW"}[target.optimizer]
    report.add("tag", Status.EXACT, f"{path} ({', '.join(sorted(p.name for p in path.iterdir()))}); latest names it")
    report.add("model", Status.EXACT, "; ".join(f"group {g}: {len(names)} trainable" for g, names in
                                                 enumerate(src.groups))
               + f"; frozen {src.frozen or 'none'}; buffers {src.buffers or 'none'}; tied {src.shared or 'none'}")
    report.add("optimizer", Status.EXACT, f"fp32 masters and exp_avg, exp_avg_sq, step {int(src.step.item())} "
               f"for {optimizer}; hyperparameters from the source's param groups")
    if scheduler is None:
        report.add("lr_scheduler", Status.NOT_EXPRESSIBLE, "the source saved no scheduler state"
                   + (": DeepSpeed's load_checkpoint fails on the JSON's scheduler; load with "
                      "load_lr_scheduler_states=False and set its last_batch_iteration" if target.scheduler else ""))
    else:
        report.add("lr_scheduler", Status.EXACT, "last_batch_iteration " + str(scheduler["last_batch_iteration"])
                   if set(scheduler) == {"last_batch_iteration"} else "the source's scheduler state, as saved")
    report.add("counters", Status.EXACT, ", ".join(f"{k} {v}" for k, v in counters.items()))
    if client:
        report.add("client_state", Status.EXACT, f"keys {sorted(map(str, client))}, merged into the model states")
    report.add("rng", Status.NOT_EXPRESSIBLE, "DeepSpeed's checkpoints keep no RNG state: each rank's generators "
               "start from the DeepSpeed run's seeds")
    return report
