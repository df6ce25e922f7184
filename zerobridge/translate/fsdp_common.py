"""What the FSDP1 and FSDP2 readers share: walking a JSON form through its
table, reading values the way torch does, the ``training_loop`` section, wrap
policies and meshes.

    >>> from zerobridge.translate.fsdp_common import read_keys, read_training_loop
    >>> from zerobridge.translate.report import Report
    >>> from zerobridge.translate.sources import parse_json
    >>> report = Report(source="fsdp2", target="spec")
    >>> form = parse_json('{"training_loop": {"clip_grad_norm": 0, "gradient_accumulation_steps": 4}}', "f.json")
    >>> loop = read_training_loop(read_keys(form, "fsdp2", report))
    >>> loop.batch.clip_grad_norm, loop.batch.accumulation_steps
    (None, 4)
    >>> [e.status.value for e in report if e.key == "training_loop.clip_grad_norm"]
    ['equivalent']

The translators are ``fsdp1.py`` (``read_fsdp1``/``write_fsdp1``) and
``fsdp2.py`` (``read_fsdp2``/``write_fsdp2``); what only their writers share
(stage plan, offload, precision, the settings FSDP fixes where DeepSpeed has a
knob) is in ``fsdp_write.py``, and the live torch objects are built in
``zerobridge/backends/fsdp/kwargs.py``. Both JSON forms are FSDP's own
arguments plus a reserved ``training_loop`` section: what the loop around FSDP
must do (clipping, accumulation, loss scaling), so that no run depends on a
silent default. A table row without ``default`` means torch's default is
``None`` (TOML has no null). ``read_keys`` walks a form through its table with
``keys.SourceKeys`` (every section is strict); ``take``, ``choice`` and
``section`` read one value as torch does and record it in the report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from pydantic import ValidationError

from zerobridge.spec import (
    AUTO,
    BatchSpec,
    DType,
    DynamicLossScale,
    GradSync,
    LossScaling,
    NoLossScale,
    RootWrap,
    SizeWrap,
    TransformerWrap,
    WrapSpec,
    is_auto,
)
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.mapping import Row, load_table
from zerobridge.translate.report import Report, Status
from zerobridge.translate.sources import Located
from zerobridge.translate.values import as_int, name_in_torch

__all__ = [
    "DIM_NAMES", "PER_UNIT", "TrainingLoopForm", "accumulate_dtype_for", "check_precision", "choice", "read_keys",
    "read_mesh", "read_training_loop", "read_wrap", "section", "shown", "take",
]

DIM_NAMES: dict[int, list[str]] = {1: ["dp_shard"], 2: ["dp_replicate", "dp_shard"]}
"""Mesh dimension names zerobridge writes (dim 0 replicates, the last shards)."""
PER_UNIT: Final = "per_unit"
GRAD_SYNC_ALIASES = {"accumulation_boundary": "no_sync", "set_requires_gradient_sync(false)": "no_sync"}


def shown(value: Any) -> str:
    """A value as it is written in the JSON form."""
    return json.dumps(value)


def read_keys(located: Located, fmt: str, report: Report) -> SourceKeys:
    """The keys of one FSDP JSON form, walked through its mapping table (every
    section is strict: an unknown key is an error naming the closest one)."""
    if not isinstance(located.data, dict):
        raise located.error("expected a JSON object at the top", fix="wrap the settings in { ... }")
    return SourceKeys(located, load_table(fmt), report, consumer="torch", locate_unknown=False)


def _fetch(r: SourceKeys, path: str) -> tuple[Row, Any]:
    """The row and the value (torch's default when absent), recorded in the report."""
    row = r.table.row(path)
    if r.given(path):
        r.note(path)
        return row, r.values[path]
    value = row.default if row.has_default else None
    whose = "default" if path.startswith("training_loop") else "torch's default"
    r.report.add(path, Status.DEFAULT, f"not set: {whose} {shown(value)}", target=row.spec)
    return row, value


def section(r: SourceKeys, path: str) -> dict[str, Any] | None:
    """The object at ``path``; ``None`` when it is null or absent."""
    _, value = _fetch(r, path)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise r.error(path, f"expected an object {{...}} or null, got {shown(value)}")
    return value


def take(r: SourceKeys, path: str, *, minimum: float | None = None, nullable: bool = False) -> Any:
    """The coerced value at ``path``, or torch's default when absent."""
    row, value = _fetch(r, path)
    if value is None:
        if r.given(path) and row.has_default and not nullable:
            raise r.error(path, "must not be null", fix=f"remove it for torch's default {shown(row.default)}")
        return None
    if row.type == "str" and not isinstance(value, str):
        raise r.error(path, f"expected a string, got {shown(value)}")
    return r.coerce(row, value, path, minimum=minimum)


def choice(r: SourceKeys, path: str, *, aliases: Mapping[str, str | None] | None = None,
           nullable: bool = False) -> str | None:
    """One of the row's ``values``, matched case-insensitively (``torch`` enum
    prefixes dropped), or ``None`` where null is allowed."""
    row, value = _fetch(r, path)
    valid = ", ".join(row.values) + (", or null" if nullable else "")
    if value is None:
        if nullable or not row.has_default:
            return None
        raise r.error(path, "must not be null", fix=f"use one of {valid}")
    name = str(value).strip() if not isinstance(value, bool) else ""
    name = name.rsplit(".", 1)[-1] if not name.replace(".", "").isdigit() else name
    by_name = {v.lower(): v for v in row.values} | dict(aliases or {})
    if name.lower() not in by_name:
        raise r.error(path, f"unknown value {shown(value)}", fix=f"use one of {valid}")
    return by_name[name.lower()]


# ----------------------------------------------------------------- reading


class TrainingLoopForm(NamedTuple):
    """The ``training_loop`` section, as spec values."""

    batch: BatchSpec
    activation_checkpointing: bool
    master_dtype: DType
    loss_scaling: LossScaling
    skip_nonfinite_steps: bool


def read_training_loop(r: SourceKeys) -> TrainingLoopForm:
    """Read ``training_loop``; absent clipping and accumulation are left to the training script
    (``"auto"``), every other absent key takes the default stated in the table (micro and
    global batch: null, chosen by the data loader)."""
    section(r, "training_loop")
    p = "training_loop."
    clip = take(r, p + "clip_grad_norm", minimum=0.0) if r.given(p + "clip_grad_norm") else AUTO
    if clip == 0:
        clip = None
        r.mark(p + "clip_grad_norm", Status.EQUIVALENT, "0 means no clipping, as in DeepSpeed: read as null")
    accumulation: Any = AUTO
    if r.given(p + "gradient_accumulation_steps"):
        accumulation = take(r, p + "gradient_accumulation_steps", minimum=1, nullable=True)
        if accumulation is None:
            r.mark(p + "gradient_accumulation_steps", Status.EXACT, "null: derived by the loop as "
                   "global_batch_size / (micro_batch_size x data-parallel size)")
    sync = choice(r, p + "grad_sync", aliases=GRAD_SYNC_ALIASES)
    micro = take(r, p + "micro_batch_size", minimum=1)
    global_batch = take(r, p + "global_batch_size", minimum=1)
    for name, value in (("clip_grad_norm", clip), ("gradient_accumulation_steps", accumulation)):
        if is_auto(value):
            r.report.add(p + name, Status.AUTO, "absent: left to the training script (HF Trainer fills it from "
                         "TrainingArguments)", target=r.table.row(p + name).spec)
    activation_checkpointing = take(r, p + "activation_checkpointing")
    master = take(r, p + "master_dtype")
    loss: LossScaling = NoLossScale()
    if section(r, p + "loss_scaler") is not None:
        s = p + "loss_scaler."
        init, growth = take(r, s + "init_scale"), take(r, s + "growth_factor")
        backoff, interval = take(r, s + "backoff_factor"), take(r, s + "growth_interval", minimum=1)
        for key, ok, rule in ((s + "init_scale", init > 0, "> 0"), (s + "growth_factor", growth > 1, "> 1"),
                              (s + "backoff_factor", 0 < backoff < 1, "between 0 and 1")):
            if not ok:
                raise r.error(key, f"must be {rule}, got {r.values.get(key)!r}")
        loss = DynamicLossScale(initial_scale=init, growth_factor=growth, backoff_factor=backoff,
                                growth_interval=interval, hysteresis=1, consecutive_hysteresis=False,
                                min_scale=0.0)
    skip_key = p + "skip_nonfinite_steps"
    skip = take(r, skip_key)
    if loss.kind != "none":
        if r.given(skip_key) and not skip:
            raise r.error(skip_key, "false contradicts loss_scaler: the scaler skips every step whose "
                          "gradients are not finite", fix="remove skip_nonfinite_steps or set it to true")
        skip = True
        r.mark(skip_key, Status.DEFAULT if not r.given(skip_key) else Status.EXACT,
               "true: the loss scaler skips steps whose gradients are not finite")
    try:
        batch = BatchSpec(micro_batch_size=micro, accumulation_steps=accumulation, global_batch_size=global_batch,
                          grad_sync=GradSync.ACCUMULATION_BOUNDARY if sync == "no_sync" else GradSync.EVERY_MICRO_STEP,
                          clip_grad_norm=clip)
    except ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise r.error(p + "global_batch_size", message) from None
    return TrainingLoopForm(batch, activation_checkpointing, master, loss, skip)


def check_precision(r: SourceKeys, param_key: str, param: DType, master: DType, loss: LossScaling) -> None:
    """Combinations FSDP runs but the spec cannot state."""
    if master not in (DType.FP32, param):
        raise r.error(param_key, f"compute dtype {name_in_torch(param)} with a model loaded in "
                      f"{name_in_torch(master)}: the spec states master weights as fp32 or the compute dtype",
                      fix="load the model in float32, or compute in its loaded dtype")
    if loss.kind != "none" and param is not DType.FP16:
        raise r.error("training_loop.loss_scaler", f"a loss scaler only applies to float16 compute, but compute "
                      f"runs in {name_in_torch(param)}", fix="set loss_scaler to null")


def accumulate_dtype_for(sync: GradSync, *, master: DType, unsharded: DType) -> DType:
    """Where FSDP sums gradients across micro-batches: reduced shards in the
    loaded dtype; with gradient sync off, unsharded gradients in ``unsharded``."""
    return unsharded if sync is GradSync.ACCUMULATION_BOUNDARY else master


def read_wrap(r: SourceKeys, path: str) -> WrapSpec:
    """``{"transformer_layer_cls": [...]}``, ``{"min_num_params": n}`` or null."""
    data = section(r, path)
    if data is None:
        return RootWrap()
    keys = [k for k in ("transformer_layer_cls", "min_num_params") if k in data]
    if len(keys) != 1:
        raise r.error(path, "give exactly one of transformer_layer_cls and min_num_params",
                      fix="or null for a single unit")
    if keys[0] == "min_num_params":
        return SizeWrap(min_params=take(r, f"{path}.min_num_params", minimum=1))
    key = f"{path}.transformer_layer_cls"
    names = take(r, key)
    if is_auto(names):
        r.mark(key, Status.AUTO, "\"auto\": the model's _no_split_modules, resolved at wrap time")
        return TransformerWrap(layer_classes=AUTO)
    if isinstance(names, str):
        names = names.split(",")
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names) or not names:
        raise r.error(key, f"expected a list of class names or \"auto\", got {shown(names)}",
                      fix='e.g. ["LlamaDecoderLayer"]')
    return TransformerWrap(layer_classes=tuple(dict.fromkeys(n.strip() for n in names)))


def read_mesh(r: SourceKeys, path: str) -> tuple[int, ...] | None:
    """The mesh shape (1-D or 2-D), carrying non-default dimension names."""
    data = section(r, path)
    if data is None:
        return None
    shape = take(r, f"{path}.shape")
    if not isinstance(shape, list) or len(shape) not in (1, 2):
        raise r.error(f"{path}.shape", f"expected [world] or [replicas, shard_size], got {shown(shape)}")
    dims = tuple(as_int(r.located, f"{path}.shape", n, minimum=1) for n in shape)
    names_key = f"{path}.mesh_dim_names"
    names = take(r, names_key)
    if names is not None:
        if (not isinstance(names, list) or len(names) != len(dims) or len(set(names)) != len(names)
                or not all(isinstance(n, str) and n for n in names)):
            raise r.error(names_key, f"expected {len(dims)} distinct names, got {shown(names)}",
                          fix=f"e.g. {shown(DIM_NAMES[len(dims)])}")
        r.carry(names_key, names, DIM_NAMES[len(dims)])
    return dims
