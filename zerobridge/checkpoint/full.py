"""Consolidated weights as one safetensors file, written one tensor at a time.

    >>> import tempfile, pathlib, torch
    >>> from safetensors.torch import load_file
    >>> from zerobridge.checkpoint.full import write_safetensors
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> w = torch.arange(6.0).reshape(2, 3)
    >>> write_safetensors(path, {"a.weight": w, "b.weight": w}, dtype=torch.bfloat16)
    >>> {k: (v.dtype, v.tolist()[0]) for k, v in load_file(path).items()}
    {'a.weight': (torch.bfloat16, [0.0, 1.0, 2.0]), 'b.weight': (torch.bfloat16, [0.0, 1.0, 2.0])}

The safetensors layout is an 8-byte little-endian header length, a JSON
header (name -> dtype, shape, byte range; ``__metadata__`` with
``"format": "pt"``, which Hugging Face's ``from_pretrained`` expects),
padded with spaces to 8 bytes, then the tensors' bytes back to back. The
header needs only names, shapes and dtypes, so the data is streamed: a
checkpoint of any size consolidates holding one tensor in memory. Tied
weights are written under each name (``load_file`` returns every name;
``from_pretrained`` ties them again). The file is written to a temporary
sibling and renamed into place.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from zerobridge.checkpoint.reader import open_checkpoint
from zerobridge.checkpoint.storage import CheckpointError, atomic_write_file

__all__ = ["DTYPES", "consolidate", "write_safetensors"]

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype`` choices: floating tensors are cast; others keep their dtype."""


def _cast(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and dtype.is_floating_point else dtype


def _check_output(path: Path) -> None:
    if path.is_dir():
        raise CheckpointError("is a directory", source=path, fix="name the .safetensors file to write, "
                              "e.g. -o model.safetensors")


def _write(path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
           fetch: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> None:
    _check_output(path)
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _CODES:
            raise CheckpointError(f"has dtype {dtype}, which safetensors cannot store", key=name,
                                  fix="pass dtype=torch.float32 (or --dtype fp32)")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            fh.write(struct.pack("<Q", len(text)))
            fh.write(text)
            for name, shape, dtype in specs:
                value = fetch(name).detach().to(device="cpu", dtype=dtype).contiguous()
                if tuple(value.shape) != shape:
                    raise AssertionError(f"{name}: shape {tuple(value.shape)}, header says {shape}")
                fh.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    atomic_write_file(path, write)


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (floating ones cast to ``dtype``) to ``path`` atomically."""
    specs = [(name, tuple(t.shape), _cast(t.dtype, dtype)) for name, t in tensors.items()]
    _write(Path(path), specs, tensors.__getitem__, {"format": "pt", **(metadata or {})})


def consolidate(path: str | Path, output: str | Path, *, dtype: torch.dtype | None = None) -> list[str]:
    """The model weights of a sharded checkpoint (any layout that wrote it) as one
    safetensors file; no process group needed. Returns the names written."""
    _check_output(Path(output))
    ckpt = open_checkpoint(path)
    keys = [k for k in ckpt if k.startswith("model.") and ckpt.tensor(k) is not None]
    if not keys:
        raise CheckpointError("holds no model.* tensors", source=ckpt.source,
                              fix="consolidate a checkpoint saved with a model (zerobridge.save_checkpoint or "
                                  "dcp.save({'model': ...}))")
    specs = []
    for key in keys:
        md = ckpt.tensor(key)
        assert md is not None
        specs.append((key[len("model."):], tuple(md.size), _cast(md.properties.dtype, dtype)))
    _write(Path(output), specs, lambda name: ckpt.full(f"model.{name}"),
           {"format": "pt", "zerobridge.source": str(Path(path).name)})
    return [name for name, _, _ in specs]
