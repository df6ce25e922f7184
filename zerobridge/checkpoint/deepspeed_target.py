"""The DeepSpeed run a checkpoint export is for: what of its JSON decides the files' layout, and what the export
refuses to write.

    >>> from zerobridge.checkpoint.deepspeed_target import read_target
    >>> target = read_target(2, 8, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}})
    >>> target.optimizer, target.adam_w_mode                         # DeepSpeed builds FusedAdam from this JSON
    ('fused_adam', True)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerobridge.checkpoint.storage import CheckpointError

__all__ = ["SUPPORTED", "DeepSpeedTarget", "read_target"]

_FIX_CONFIG = "pass --config with the DeepSpeed JSON the run will use, or change that JSON"
SUPPORTED = ("fp32 runs of Adam or AdamW (DeepSpeed's FusedAdam, torch's with torch_adam, or a torch Adam/AdamW "
             "client optimizer when the JSON has no optimizer section), ZeRO stages 1-3, no offload")
"""What the export writes, for the refusals' messages."""


@dataclass(frozen=True)
class DeepSpeedTarget:
    """The DeepSpeed run the export is for: what of its JSON decides the layout."""

    stage: int
    world_size: int
    optimizer: str
    """``"fused_adam"`` (the JSON's Adam/AdamW: DeepSpeed builds FusedAdam, ``step`` an int) or ``"torch"``
    (``torch_adam``, or no optimizer section: a torch Adam/AdamW the script passes; ``step`` a tensor)."""
    adam_w_mode: bool | None = None
    """Decoupled weight decay as the JSON asks; ``None``: the source's (a client optimizer)."""
    round_robin: bool = False
    parameter_alignment: bool = False
    sub_group_size: int = 1_000_000_000
    scheduler: bool = False
    """The JSON has a scheduler section: DeepSpeed's own schedule, which takes ``{"last_batch_iteration": n}``."""
    clip_grad: float | None = None
    """``gradient_clipping`` when a JSON was given (DeepSpeed restores it from the optimizer files)."""
    config: dict[str, Any] = field(default_factory=dict)
    source: str | None = None


def _section(config: dict[str, Any], key: str, source: str | None) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{key} is a {type(value).__name__}, not an object", source=source, key=key,
                              fix=_FIX_CONFIG)
    return value


def read_target(stage: int, world_size: int, config: str | Path | dict[str, Any] | None = None) -> DeepSpeedTarget:
    """The layout DeepSpeed 0.19.8 uses for ``config`` (a JSON file or dict; ``None``: an fp32 run with
    DeepSpeed's defaults and a torch Adam/AdamW client optimizer) at ``stage`` and ``world_size``; refuses
    what the export does not write."""
    source = None
    if isinstance(config, (str, Path)):
        source = str(config)
        try:
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError("no such DeepSpeed config", source=source, fix="pass the JSON file the run uses"
                                  ) from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"is not JSON ({exc.msg}, line {exc.lineno})", source=source,
                                  fix="fix the JSON (the export reads plain JSON, not hjson)") from None
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"a DeepSpeed config is a JSON object, got a {type(config).__name__}", source=source,
                              fix=_FIX_CONFIG)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"ZeRO stage {stage}: only stages 1-3 are written", key="stage",
                              fix="a stage 0 run loads a plain state dict: zerobridge checkpoint consolidate "
                                  "writes the weights; or export for stage 1, which keeps the same numbers")
    if world_size < 1:
        raise CheckpointError(f"world size {world_size}", key="world_size", fix="pass the data-parallel world size, "
                              "the number of ranks of the DeepSpeed run (>= 1)")
    given = config is not None
    config = dict(config or {})
    zero = _section(config, "zero_optimization", source)
    said = zero.get("stage")
    if isinstance(said, int) and said != stage:
        raise CheckpointError(f"the JSON says ZeRO stage {said} but --stage {stage} was asked", source=source,
                              key="zero_optimization.stage", fix="ask for the stage the JSON runs, or change it")
    refusals = [
        (_section(config, "fp16", source).get("enabled") in (True, "auto"),
         "fp16", "fp16 runs keep a dynamic loss scaler whose state DeepSpeed pickles as its own object"),
        (_section(config, "bf16", source).get("enabled") in (True, "auto")
         or _section(config, "bfloat16", source).get("enabled") in (True, "auto"),
         "bf16", "bf16 runs keep 16-bit module copies and bf16_-prefixed files this export does not write"),
        ((_section(zero, "offload_optimizer", source).get("device") or "none") != "none",
         "zero_optimization.offload_optimizer", "optimizer offload builds DeepSpeedCPUAdam (and NVMe swaps its state)"),
        ((_section(zero, "offload_param", source).get("device") or "none") != "none",
         "zero_optimization.offload_param", "parameter offload is not a layout this export was checked against"),
        (stage == 3 and zero.get("elastic_checkpoint") is True, "zero_optimization.elastic_checkpoint",
         "DeepSpeed 0.19.8 raises NotImplementedError for ZeRO-3 elastic checkpoints"),
        (_section(config, "checkpoint", source).get("load_universal") is True, "checkpoint.load_universal",
         "a universal-checkpoint run reads latest_universal and per-parameter folders, not ZeRO files"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise CheckpointError(f"{why}: not written (supported: {SUPPORTED})", source=source, key=key,
                                  fix="export for an fp32 config without offload, resume there, and change the "
                                      "setting after DeepSpeed saves its own checkpoint")
    optimizer = _section(config, "optimizer", source)
    kind, adam_w_mode = "torch", None
    if optimizer:
        name = str(optimizer.get("type", "")).lower()
        params = _section(optimizer, "params", source)
        if name not in ("adam", "adamw"):
            raise CheckpointError(f"optimizer type {optimizer.get('type')!r}: only Adam and AdamW state is written",
                                  source=source, key="optimizer.type",
                                  fix="use Adam or AdamW in the DeepSpeed run (the source's state is Adam's)")
        adam_w_mode = name == "adamw" or bool(params.get("adam_w_mode", True))
        kind = "torch" if params.get("torch_adam") is True else "fused_adam"
    sub_group_size = zero.get("sub_group_size", 1_000_000_000)
    if isinstance(sub_group_size, float) and sub_group_size.is_integer():
        sub_group_size = int(sub_group_size)  # DeepSpeed reads 1e9 as an integer
    if isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < 0:
        raise CheckpointError(f"sub_group_size {sub_group_size!r}: the export needs the number DeepSpeed will use",
                              source=source, key="zero_optimization.sub_group_size", fix="write it as an integer")
    clip = config.get("gradient_clipping", 0.0)
    return DeepSpeedTarget(stage=stage, world_size=world_size, optimizer=kind, adam_w_mode=adam_w_mode,
                           round_robin=zero.get("round_robin_gradients") is True,
                           parameter_alignment=zero.get("parameter_alignment") is True,
                           sub_group_size=sub_group_size, scheduler=bool(_section(config, "scheduler", source)),
                           clip_grad=float(clip) if given and isinstance(clip, (int, float)) else None,
                           config=config if given else {"zero_optimization": {"stage": stage}}, source=source)
