"""Read a DeepSpeed ZeRO checkpoint (stages 1-3) into a ``PortableState``.

    >>> from zerobridge.checkpoint.deepspeed_import import import_deepspeed_checkpoint   # doctest: +SKIP
    >>> state, report = import_deepspeed_checkpoint("runs/ds")   # doctest: +SKIP
    >>> print(report.render())                      # doctest: +SKIP

Parameters and their optimizer state are rebuilt from the fp32 master
partitions and the base optimizer's per-rank state; the LR scheduler's
state (``lr_scheduler``) and the client state (the keys ``client_state``
added) come along as ``PortableState.scheduler`` and ``.client_state``, the
counters (``global_steps``, ``global_samples``, ``skipped_steps``) in the
metadata, and ``run_extras`` gives the skipped-step count the engines
restore. DeepSpeed is never
imported; nothing is unpickled but tensors, plain containers and inert
stand-ins for the three DeepSpeed classes the files name.

[Note: DeepSpeed ZeRO checkpoint layout] (DeepSpeed 0.19). ``<root>/latest``
names the tag directory. Its model file (``mp_rank_00_model_states.pt``;
stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank) holds
``module`` (stage 3: empty placeholders for parameters), ``param_shapes``
(name -> size per flat group, in flat order), ``frozen_param_shapes`` and
``frozen_param_fragments`` (stage 2 on; stage 1 keeps frozen weights in ``module``
only), ``shared_params`` (tied alias -> owner), ``buffer_names``,
``lr_scheduler`` (the scheduler's ``state_dict()``: ``{"last_batch_iteration":
n}`` for DeepSpeed's own schedules, ``None`` without one), ``global_steps``,
``global_samples``, ``skipped_steps``, ``ds_config``, ``checkpoint_parallel_dimensions``
and the ``client_state`` keys, merged in at the top level (DeepSpeed's
``load_checkpoint`` hands back every key but a few of its own as the client
state, ``ds_config`` and ``param_shapes`` included; stage 3 writes each rank's
own ``client_state`` into its own file). Each rank's
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds
``optimizer_state_dict``. Stages 1-2: group g's trainable parameters lie end
to end, each followed by ``param_alignment_paddings[g][j]`` elements, the
whole padded to a multiple of 2 * world and cut in world equal parts;
``single_partition_of_fp32_groups[g]`` is rank r's part minus the end
padding; ``base_optimizer_state`` is the base optimizer's ``state_dict()``
(one flat parameter per group, state padded) or, with
``elastic_checkpoint``, per-group states already cut. The BF16 optimizer
(bf16 + ZeRO-1 + fp32 gradient accumulation) writes no ``zero_stage`` and
keeps the padding (``group_paddings``). Stage 3: ``fp32_flat_groups[k]`` is
rank r's part of sub-group k: per parameter of ``param_shapes[k]``,
ceil(numel / world) elements (the last ranks zero-padded); the inner
``optimizer_state_dict`` has one flat parameter per sub-group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerobridge.checkpoint.deepspeed_files import MODEL_STATE_KEYS, RESAVE_FIX, TagFiles, find_tag, open_tag
from zerobridge.checkpoint.layout import ZB
from zerobridge.checkpoint.portable import PortableState
from zerobridge.errors import ConfigError
from zerobridge.translate.report import Entry, Report, Status

if TYPE_CHECKING:
    from zerobridge.checkpoint.portable import PortableState

__all__ = ["import_deepspeed_checkpoint", "run_extras"]

def _split_state(states: list[dict[str, Any]], lengths: list[int], source: Path, group: str,
                 notes: list[Entry]) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """One flat group's per-rank state: flat tensors cut to each rank's fp32 part, scalars checked equal."""
    flats: dict[str, list[torch.Tensor]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for key in states[0]:
        values: list[Any] = [s.get(key) for s in states]
        if all(isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() >= n for v, n in zip(values, lengths)):
            flats[key] = [v[:n] for v, n in zip(values, lengths)]
        elif all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in values):
            tensors = [v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in values]
            if any(not torch.equal(tensors[0], t) for t in tensors):
                raise ConfigError(f"ranks disagree on the optimizer scalar {key!r}", source=source,
                                  key=f"{group}.{key}", fix=RESAVE_FIX)
            scalars[key] = tensors[0]
        else:
            notes.append(Entry(f"optimizer.{group}.{key}", Status.NOT_EXPRESSIBLE,
                               "optimizer state not shaped like the fp32 partition: dropped"))
    return flats, scalars


class _Builder:
    """Collects parameters, their optimizer state and group membership."""

    def __init__(self) -> None:
        self.model: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, dict[str, torch.Tensor]] = {}
        self.group_of: dict[str, int] = {}
        self.widened: list[str] = []
        self.notes: list[Entry] = []

    def add(self, name: str, shape: torch.Size, group: int, pieces: list[torch.Tensor],
            state: dict[str, list[torch.Tensor]], scalars: dict[str, torch.Tensor]) -> None:
        """One trainable parameter from its pieces (in rank order, padding at the end)."""
        numel = math.prod(shape)
        self.model[name] = torch.cat(pieces)[:numel].view(shape).clone()
        self.optimizer[name] = {k: torch.cat(v)[:numel].view(shape).clone() for k, v in state.items()}
        self.optimizer[name] |= {k: v.clone() for k, v in scalars.items()}
        self.group_of[name] = group

    def put(self, name: str, value: torch.Tensor) -> None:
        """A frozen parameter or buffer as saved; 16-bit floats widened to fp32."""
        if value.dtype in (torch.bfloat16, torch.float16):
            self.widened.append(name)
        self.model[name] = value.float() if value.is_floating_point() else value.clone()


def _read_stage12(build: _Builder, files: TagFiles) -> list[dict[str, Any]]:
    """Stages 1-2 and the BF16 optimizer; returns the base optimizer's param groups."""
    optims, shapes, source = files.optims, files.models[0]["param_shapes"], files.optim_paths[0]
    base = [o["base_optimizer_state"] for o in optims]
    elastic = isinstance(base[0], list)
    paddings = optims[0].get("param_alignment_paddings") or [[0] * len(x) for x in shapes]
    for g, group_shapes in enumerate(shapes):
        parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
        if elastic:  # a "step" kept in the param group (not torch's optimizers) is saved apart
            steps = [{"step": o["base_optimizer_state_step"]} if "base_optimizer_state_step" in o else {}
                     for o in optims]
            states = [s | dict(b[g]) for s, b in zip(steps, base)]
        else:
            states = [b["state"].get(b["param_groups"][g]["params"][0], {}) for b in base]
        flats, scalars = _split_state(states, [p.numel() for p in parts], source, f"group{g}", build.notes)
        flat = torch.cat(parts)
        flat_state = {k: torch.cat(v) for k, v in flats.items()}
        offset = 0
        for (name, shape), pad in zip(group_shapes.items(), paddings[g]):
            end = offset + math.prod(shape)
            build.add(name, shape, g, [flat[offset:end]], {k: [v[offset:end]] for k, v in flat_state.items()},
                      scalars)
            offset = end + pad
        tail = 0 if "zero_stage" in optims[0] else sum(o["group_paddings"][g] for o in optims)
        if flat.numel() - offset != tail:
            raise ConfigError(f"param_shapes account for {offset} elements of flat group {g} but the {len(parts)} "
                              f"fp32 partitions hold {flat.numel()} ({tail} expected as padding)", source=source,
                              key=f"single_partition_of_fp32_groups.{g}", fix=RESAVE_FIX)
    return [] if elastic else [dict(g) for g in base[0]["param_groups"]]


def _read_stage3(build: _Builder, files: TagFiles) -> list[dict[str, Any]]:
    """Stage 3: each parameter is cut into ceil(numel / world) pieces, one per rank."""
    optims, shapes, source = files.optims, files.models[0]["param_shapes"], files.optim_paths[0]
    inner = [o["optimizer_state_dict"] for o in optims]
    groups = [dict(g) for g in inner[0]["param_groups"]]
    owners = [(g, idx) for g, group in enumerate(groups) for idx in group["params"]]
    if len(owners) != len(shapes) or any(len(o["fp32_flat_groups"]) != len(shapes) for o in optims):
        raise ConfigError(f"{len(shapes)} sub-groups in param_shapes but {len(owners)} in the optimizer state",
                          source=source, key="fp32_flat_groups", fix=RESAVE_FIX)
    for k, ((g, idx), group_shapes) in enumerate(zip(owners, shapes)):
        parts = [o["fp32_flat_groups"][k] for o in optims]
        sizes = [math.ceil(math.prod(s) / files.world) for s in group_shapes.values()]
        if any(p.numel() != sum(sizes) for p in parts):
            raise ConfigError(f"sub-group {k}: param_shapes need {sum(sizes)} elements per rank, the partitions "
                              f"hold {[p.numel() for p in parts]}", source=source, key=f"fp32_flat_groups.{k}",
                              fix=RESAVE_FIX)
        states = [i["state"].get(idx, {}) for i in inner]
        flats, scalars = _split_state(states, [p.numel() for p in parts], source, f"subgroup{k}", build.notes)
        offset = 0
        for (name, shape), size in zip(group_shapes.items(), sizes):
            end = offset + size
            build.add(name, shape, g, [p[offset:end] for p in parts],
                      {key: [t[offset:end] for t in v] for key, v in flats.items()}, scalars)
            offset = end
    return groups


def _read_frozen(build: _Builder, files: TagFiles) -> list[str]:
    """Frozen parameters: fragments (stage 2 whole, stage 3 one per rank) or, at stage 1, ``module``."""
    head = files.models[0]
    shapes = head.get("frozen_param_shapes")
    if shapes is None:
        taken = set(build.group_of) | set(head["buffer_names"]) | set(head.get("shared_params") or {})
        values = {n: v for n, v in head["module"].items() if n not in taken and v.numel() > 0}
        if files.stage == 3 and any(n not in taken for n in head["module"]):  # exclude_frozen_parameters
            build.notes.append(Entry("frozen_param_fragments", Status.NOT_EXPRESSIBLE, "frozen weights not saved"))
    elif files.stage == 3:
        values = {n: torch.cat([m["frozen_param_fragments"][n].flatten() for m in files.models])[:math.prod(s)]
                  .view(s) for n, s in shapes.items()}
    else:
        values = dict(head["frozen_param_fragments"])
    for name, value in values.items():
        build.put(name, value)
    return list(values)


def import_deepspeed_checkpoint(directory: str | Path, tag: str | None = None) -> tuple[PortableState, Report]:
    """The model and optimizer state of a DeepSpeed ZeRO checkpoint, whole.

    ``directory`` is the ``save_checkpoint`` directory (its ``latest`` file
    names the tag unless ``tag`` is given) or one ``global_stepN`` directory.
    """

    tag_dir, tag = find_tag(Path(directory), tag)
    files = open_tag(tag_dir)
    head, first = files.models[0], files.optims[0]
    build = _Builder()
    groups = (_read_stage3 if files.stage == 3 else _read_stage12)(build, files)
    frozen = _read_frozen(build, files)
    buffers = [n for n in head["buffer_names"] if n in head["module"]]
    for name in buffers:
        build.put(name, head["module"][name])
    shared = {a: o for a, o in (head.get("shared_params") or {}).items() if o in build.model}
    for alias, owner in shared.items():
        build.model[alias] = build.model[owner]
    order = {name: i for i, name in enumerate(head["module"])}
    num_groups = len(groups) or 1 + max(build.group_of.values(), default=-1)
    members = [sorted((n for n, i in build.group_of.items() if i == g), key=lambda n: order.get(n, 0))
               for g in range(num_groups)]
    param_groups = [{k: v for k, v in (groups[g] if groups else {}).items() if k != "params"} | {"params": names}
                    for g, names in enumerate(members)]
    scale = getattr(first.get("loss_scaler"), "cur_scale", None)
    metadata: dict[str, Any] = {
        "source": "deepspeed", "zero_stage": files.stage, "world_size": files.world, "tag": tag,
        "global_step": head.get("global_steps"), "global_samples": head.get("global_samples"),
        "skipped_steps": head.get("skipped_steps"), "ds_version": head.get("ds_version"),
        "loss_scale": float(scale) if isinstance(scale, (int, float)) else None,
        "dynamic_loss_scale": bool(first.get("dynamic_loss_scale", False)),
        "layout": "zero" if "zero_stage" in first else "bf16_optimizer",
        "precision": "bf16" if files.optim_paths[0].name.startswith("bf16_") else  # fp16 files carry no prefix
        "fp16" if ((head.get("ds_config") or {}).get("fp16") or {}).get("enabled") is True else "fp32",
        "param_group_of": dict(build.group_of), "frozen": frozen, "buffers": buffers, "shared": shared,
        "ds_config": json.loads(json.dumps(head.get("ds_config"), default=str)),
        "deepspeed": {name: int(head[name]) for name in ("global_steps", "global_samples", "skipped_steps")
                      if isinstance(head.get(name), int)}}  # the counters, as zerobridge.deepspeed's engine saves them
    scheduler = head.get("lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, dict):
        raise ConfigError(f"lr_scheduler is a {type(scheduler).__name__}, not a state_dict()",
                          source=files.model_paths[0], key="lr_scheduler", fix=RESAVE_FIX)
    client_state = {key: value for key, value in head.items() if key not in MODEL_STATE_KEYS}
    keys = sorted({k for s in build.optimizer.values() for k in s})
    read = [Entry("tag", Status.EXACT, f"{tag_dir}: ZeRO-{files.stage}, world size {files.world}, read "
                  + ", ".join(p.name for p in files.model_paths + files.optim_paths)),
            Entry("param_shapes", Status.EXACT, f"{len(build.group_of)} trainable parameters with state {keys}, "
                  f"{len(frozen)} frozen, {len(buffers)} buffers, {len(shared)} tied aliases")]
    report = Report("deepspeed", "zerobridge checkpoint", read + _notes(head, first, bool(groups), build.widened)
                    + build.notes)
    return PortableState(model=build.model, optimizer=build.optimizer, param_groups=param_groups,
                         metadata=metadata, scheduler=scheduler, client_state=client_state), report


def run_extras(state: PortableState) -> dict[str, torch.Tensor]:
    """What ``write_portable(extras=...)`` adds for an import: DeepSpeed's skipped-step count, which every
    backend's ``load_checkpoint`` restores as its own."""
    skipped = state.metadata.get("skipped_steps")
    return {f"{ZB}.skipped_steps": torch.tensor(skipped, dtype=torch.int64)} if isinstance(skipped, int) else {}


def _brief(state: object) -> str:
    if isinstance(state, dict) and set(state) == {"last_batch_iteration"}:
        return f"DeepSpeed schedule at last_batch_iteration {state['last_batch_iteration']}"
    if isinstance(state, dict) and "last_epoch" in state:
        return f"torch scheduler at last_epoch {state['last_epoch']}"
    return "state_dict()"


def _notes(head: dict[str, Any], first: dict[str, Any], has_groups: bool, widened: list[str]) -> list[Entry]:
    """Report entries for what the import drops or keeps only approximately."""
    notes = [Entry(key, Status.NOT_EXPRESSIBLE, f"{key} state dropped: rebuild it and fast-forward it to "
                   f"global_step {head.get('global_steps')}")
             for key in ("data_sampler", "random_ltd") if head.get(key) is not None]
    if head.get("lr_scheduler") is not None:
        notes.append(Entry("lr_scheduler", Status.EXACT, f"kept ({_brief(head['lr_scheduler'])}): "
                           "load_checkpoint(..., scheduler=...) restores it into a torch LRScheduler or a "
                           "DeepSpeed schedule"))
    if client := sorted(set(head) - MODEL_STATE_KEYS):
        notes.append(Entry("client_state", Status.EXACT, f"kept ({', '.join(map(str, client))}): load_checkpoint "
                           "returns it under 'client_state'" + (" (rank 0's: stage 3 saves one per rank)"
                                                                if "zero_stage" in first and
                                                                int(first["zero_stage"]) == 3 else "")))
    if not has_groups:
        notes.append(Entry("base_optimizer_state.param_groups", Status.APPROXIMATED, "elastic checkpoint: the "
                           "optimizer's hyperparameters are not saved; param groups hold only their parameters"))
    if getattr(first.get("loss_scaler"), "dynamic", False) is True:
        notes.append(Entry("loss_scaler", Status.APPROXIMATED, "dynamic loss scaler: only the current scale is "
                           "kept (metadata.loss_scale); its window and hysteresis counters restart"))
    if widened:
        notes.append(Entry("module", Status.EQUIVALENT, "frozen parameters or buffers saved in 16 bits, widened "
                           f"to float32 (exact): {', '.join(widened)}"))
    return notes
