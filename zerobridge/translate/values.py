"""Coercing source values to spec values, the way the source's consumer does.

Every function raises ``ConfigError`` through ``located.error`` so the message
names the file, key and line.
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec.base import AUTO, DType, is_auto
from zerobridge.translate.sources import Located

__all__ = ["DTYPE_NAMES", "as_bool", "as_dtype", "as_float", "as_int", "name_in_torch"]

DTYPE_NAMES: dict[str, DType] = {
    "fp32": DType.FP32, "float32": DType.FP32, "float": DType.FP32, "torch.float32": DType.FP32,
    "torch.float": DType.FP32, "32": DType.FP32, "32-true": DType.FP32, "no": DType.FP32,
    "bf16": DType.BF16, "bfloat16": DType.BF16, "torch.bfloat16": DType.BF16,
    "fp16": DType.FP16, "float16": DType.FP16, "half": DType.FP16, "torch.float16": DType.FP16,
    "torch.half": DType.FP16,
}
"""Every spelling of a dtype the supported formats use."""

_TORCH_NAMES = {DType.FP32: "float32", DType.BF16: "bfloat16", DType.FP16: "float16"}


def name_in_torch(dtype: DType) -> str:
    """The ``torch`` attribute name of ``dtype`` (``"bfloat16"``)."""
    return _TORCH_NAMES[dtype]


def as_int(located: Located, key: str, value: Any, *, auto: bool = False, minimum: int | None = 0) -> Any:
    """An integer; ``1e9`` and ``5.0e8`` count (DeepSpeed configs write them)."""
    if auto and is_auto(value):
        return AUTO
    if isinstance(value, bool):
        raise located.error(f"expected an integer, got {value!r}", key=key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and number.is_integer():
            value = int(number)
    if not isinstance(value, int):
        hint = ' or "auto"' if auto else ""
        raise located.error(f"expected an integer{hint}, got {value!r}", key=key)
    if minimum is not None and value < minimum:
        raise located.error(f"must be >= {minimum}, got {value}", key=key)
    return value


def as_float(located: Located, key: str, value: Any, *, auto: bool = False,
             minimum: float | None = None) -> Any:
    """A number."""
    if auto and is_auto(value):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise located.error(f"expected a number, got {value!r}", key=key) from None
        else:
            raise located.error(f"expected a number, got {value!r}", key=key)
    if minimum is not None and value < minimum:
        raise located.error(f"must be >= {minimum}, got {value}", key=key)
    return float(value)


def as_bool(located: Located, key: str, value: Any, *, auto: bool = False) -> Any:
    """A boolean; the strings true/false (any case) count, as in YAML configs."""
    if auto and is_auto(value):
        return AUTO
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise located.error(f"expected true or false, got {value!r}", key=key, fix="write true or false")


def as_dtype(located: Located, key: str, value: Any, *, auto: bool = False) -> Any:
    """A ``DType`` from any spelling in ``DTYPE_NAMES``."""
    if auto and is_auto(value):
        return AUTO
    name = str(value).lower() if value is not None else ""
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    raise located.error(f"unknown dtype {value!r}", key=key,
                        fix="use one of fp32, bf16, fp16 (or torch names float32, bfloat16, float16)")
