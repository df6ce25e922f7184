"""Quantized collectives in every format: DeepSpeed's ZeRO++ keys, torchtitan's and Accelerate's
float8 all-gather, and the formats that have no form for them.

    >>> from zerobridge.translate.formats import read, write
    >>> from zerobridge.translate.sources import Located
    >>> ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
    ...                             "zero_hpz_partition_size": 8}}
    >>> spec = read(Located(ds, "ds.json"), "deepspeed").value
    >>> spec.communication.wire.param_gather.value, spec.communication.wire.grad_reduce.value
    ('int8', 'int4')
    >>> out = write(spec, "fsdp2")
    >>> [e.status.value for e in out.report.entries if e.key.startswith("communication.wire")]
    ['not_expressible', 'not_expressible']

The spec states the wire format of each payload (``spec/wire.py``); the
formats state schemes:

- DeepSpeed: ``zero_quantized_weights`` is int8 parameter gathers (qwZ),
  ``zero_quantized_gradients`` int4 gradient reductions in two hops (qgZ),
  ``zero_quantized_nontrainable_weights`` frozen weights stored int8. All three
  act at stage 3 only; DeepSpeed says nothing below it, we report them
  ignored there. DeepSpeed cuts its own quantization groups (about 8,000
  elements for weights; for gradients ``max(rows, cols, world)`` groups per
  tensor): the spec's ``block_size`` and ``grad_block_size`` have no key.
- torchtitan ``[float8] enable_fsdp_float8_all_gather`` (and the newer
  ``[quantize.linear.float8]`` section): float8 parameter gathers with one
  scale per parameter tensor (its amax reduced over ranks); the spec's fp8
  has one scale per rank's shard: read as approximated. It works with torchtitan's float8 linear layers
  (``converters = ["float8"]``): the fp8 matmuls have no spec form and are
  reported.
- Accelerate ``mixed_precision: fp8`` with ``fp8_config.enable_fsdp_float8_all_gather``
  under FSDP: the same, through torchao.
- FSDP1, FSDP2 kwargs, Lightning: no form; reported with the code that gives
  it (torchao's ``convert_to_float8_training`` for float8 gathers under FSDP2).

int8 and float8 are different schemes with the same bytes (block-wise
integer scales vs one float scale): writing one as the other is an
approximation, said so.
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import Stage, StrategySpec, WireFormat
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.report import Report, Status

__all__ = ["DEEPSPEED_KEYS", "TORCHAO_RECIPE", "read_deepspeed_wire", "read_float8_gather", "report_no_wire_form",
           "write_deepspeed_wire"]

DEEPSPEED_KEYS = {"param_gather": "zero_optimization.zero_quantized_weights",
                  "grad_reduce": "zero_optimization.zero_quantized_gradients",
                  "frozen_weights": "zero_optimization.zero_quantized_nontrainable_weights"}
"""Spec field of ``communication.wire`` -> DeepSpeed's ZeRO++ switch for it."""
_DEEPSPEED_FORMAT = {"param_gather": WireFormat.INT8, "grad_reduce": WireFormat.INT4,
                     "frozen_weights": WireFormat.INT8}
FLOAT8_SCALES = ("torchao scales each parameter tensor by its amax reduced over the ranks; the native engine "
                 "scales each rank's shard of a wrap unit by its own amax: the same bytes, rounded at another "
                 "granularity")
"""How the spec's fp8 gathers differ from torchao's float8 all-gather (torchtitan, Accelerate)."""

TORCHAO_RECIPE = ("torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig("
                  "enable_fsdp_float8_all_gather=True)) before fully_shard")


def read_deepspeed_wire(keys: SourceKeys, stage: Stage) -> dict[str, Any]:
    """``communication.wire`` fields from the ZeRO++ switches of a DeepSpeed config at ``stage``."""
    fields: dict[str, Any] = {}
    for field, path in DEEPSPEED_KEYS.items():
        if not keys.given(path):
            continue
        if not keys.get(path):
            keys.note(path, Status.EXACT, "off")
            continue
        if stage is not Stage.PARAMETERS:
            keys.note(path, Status.IGNORED, f"DeepSpeed applies ZeRO++ quantization at stage 3 only and says nothing "
                                            f"at stage {stage.value}: ignored, as DeepSpeed does")
            continue
        fields[field] = _DEEPSPEED_FORMAT[field]
        keys.note(path)
    return fields


def write_deepspeed_wire(spec: StrategySpec, stage: Stage, zero: dict[str, Any], report: Report) -> None:
    """The ZeRO++ switches for ``spec``'s wire formats (DeepSpeed runs them at stage 3 only)."""
    wire = spec.communication.wire
    for field, path in DEEPSPEED_KEYS.items():
        fmt: WireFormat = getattr(wire, field)
        if fmt is WireFormat.FULL:
            continue
        key = path.split(".", 1)[1]
        target, ds_fmt = f"zero_optimization.{key}", _DEEPSPEED_FORMAT[field]
        if stage is not Stage.PARAMETERS:
            report.add(f"communication.wire.{field}", Status.NOT_EXPRESSIBLE,
                       f"DeepSpeed quantizes only at stage 3 (stage {stage.value} here): {key} would do nothing",
                       target=target)
            continue
        zero[key] = True
        if fmt is ds_fmt:
            report.add(f"communication.wire.{field}", Status.EXACT, f"{fmt.value}: {key}", target=target)
        else:
            how = ("a different scheme with the same bytes (block-wise int8 scales, not one float8 scale)"
                   if fmt is WireFormat.FP8 else
                   f"{ds_fmt.value} moves {'half' if ds_fmt is WireFormat.INT4 else 'twice'} the bytes and rounds "
                   "differently")
            report.add(f"communication.wire.{field}", Status.APPROXIMATED,
                       f"{fmt.value} -> DeepSpeed's {ds_fmt.value} ({key}): {how}", target=target)
    if stage is Stage.PARAMETERS:
        for field, fmt, default, how in (
                ("block_size", wire.param_gather, 2048, "about 8,000 elements for weights"),
                ("grad_block_size", wire.grad_reduce, 128,
                 "max(rows, cols, world) groups per gradient: hidden-size groups for a square matrix")):
            if fmt is not WireFormat.FULL and getattr(wire, field) != default:
                report.add(f"communication.wire.{field}", Status.NOT_EXPRESSIBLE,
                           f"DeepSpeed cuts its own quantization groups ({how})")


def read_float8_gather(keys: SourceKeys, path: str, *, sharded: bool, consumer: str) -> WireFormat | None:
    """``fp8`` when ``path`` (a float8 all-gather switch) is on under sharded parameters."""
    if not keys.given(path):
        return None
    if not keys.flag(path):
        keys.mark(path, Status.EXACT, "off")
        return None
    if not sharded:
        keys.mark(path, Status.IGNORED, f"{consumer} gathers float8 weights only when parameters are sharded: "
                                        "nothing is gathered here")
        return None
    keys.mark(path, Status.APPROXIMATED, f"float8 e4m3 parameter all-gathers (communication.wire.param_gather = "
                                         f"fp8): {FLOAT8_SCALES}")
    return WireFormat.FP8


def report_no_wire_form(spec: StrategySpec, report: Report, target: str, how: dict[WireFormat, str]) -> None:
    """Report each quantized payload of ``spec`` that ``target`` has no key for; ``how``: per format,
    the code that gives it there (if any)."""
    wire = spec.communication.wire
    for field in ("param_gather", "grad_reduce", "frozen_weights"):
        fmt: WireFormat = getattr(wire, field)
        if fmt is WireFormat.FULL:
            continue
        recipe = how.get(fmt) if field == "param_gather" else None
        report.add(f"communication.wire.{field}", Status.NOT_EXPRESSIBLE,
                   f"{target} has no key for {fmt.value} {field.replace('_', ' ')}"
                   + (f": {recipe}" if recipe else "; it moves full-precision payloads there"))
