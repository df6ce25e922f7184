"""Weight files read a range at a time: safetensors (one file, or a Hugging Face
directory of shards with its index) and pickle-free ``torch.load`` files.

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> from zerobridge.pretrained.files import open_weights
    >>> folder = Path(tempfile.mkdtemp())
    >>> save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(folder / "model.safetensors"))
    >>> weights = open_weights(folder)
    >>> weights.entries["w"].shape
    (2, 3)
    >>> weights.read("w", 2, 5).tolist()                # elements 2..4 of the flattened tensor
    [2.0, 3.0, 4.0]

A safetensors file is an 8-byte header length, a JSON header (each tensor's
dtype, shape and byte offsets) and the raw little-endian data. The header is
parsed and checked against the file size on every rank before anything is
read, so a truncated file is the same clear error everywhere; a range read
seeks to its bytes and reads only those. ``.bin`` / ``.pt`` files go through
``torch.load(weights_only=True, mmap=True)``: no code runs, and a slice
touches only its own pages.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerobridge.errors import ConfigError

__all__ = ["Entry", "Weights", "open_weights"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class Entry:
    """One tensor in a weight file."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """First byte of its data in ``file`` (safetensors); -1 for ``torch.load`` files."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class Weights:
    """Every tensor of a weight source by name; ``read`` gives a flat range of one."""

    def __init__(self, source: Path, entries: dict[str, Entry]) -> None:
        self.source = source
        self.entries = entries
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened (1-D, its own dtype)."""
        entry = self.entries[name]
        if entry.offset < 0:
            return self._pickled(entry.file)[name].reshape(-1)[start:stop].clone()
        out = torch.empty(stop - start, dtype=entry.dtype)
        if stop == start:
            return out
        size = out.element_size()
        view = out.view(torch.uint8).numpy().data.cast("B")  # ndarray.data: the array's memoryview
        with entry.file.open("rb") as fh:
            fh.seek(entry.offset + start * size)
            got = fh.readinto(view)
        if got != (stop - start) * size:
            raise ConfigError(f"{entry.file} ended while reading {name}", source=entry.file, key=name,
                              fix="the file is truncated: write or download it again")
        return out

    def _pickled(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._loaded:
            self._loaded[file] = _torch_load(file)
        return self._loaded[file]


def _fail(path: Path, message: str, fix: str) -> ConfigError:
    return ConfigError(message, source=path, fix=fix)


def read_safetensors_header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _fail(path, f"is {size} bytes: too short for a safetensors header", "write the file again")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise _fail(path, f"is truncated: its header alone needs {8 + length} bytes, the file has {size}",
                        "write or download the file again")
        try:
            header: dict[str, Any] = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _fail(path, f"has a corrupt safetensors header ({exc})", "write the file again") from None
    data = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype", ""))
        if dtype is None:
            raise _fail(path, f"tensor {name} has dtype {info.get('dtype')!r}, which zerobridge cannot read",
                        f"save it as one of {', '.join(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        if data + end > size:
            raise _fail(path, f"is truncated: tensor {name} ends at byte {data + end}, the file has {size}",
                        "write or download the file again")
        entries[name] = Entry(path, tuple(info["shape"]), dtype, data + begin)
    return entries


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds for bad or unsafe files
        raise _fail(path, f"cannot be read by torch.load(weights_only=True): {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}",
                    "convert it to safetensors, or re-save it as a plain state dict of tensors") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise _fail(path, "does not hold a flat state dict of tensors", "save model.state_dict() itself")
    return loaded


def _pickled_entries(path: Path) -> dict[str, Entry]:
    return {name: Entry(path, tuple(t.shape), t.dtype, -1) for name, t in _torch_load(path).items()}


def _from_index(index: Path, read: Any) -> dict[str, Entry]:
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _fail(index, f"is not a shard index with a weight_map ({exc})", "write the index again") from None
    entries: dict[str, Entry] = {}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        shard = index.parent / file
        if not shard.is_file():
            raise _fail(index, f"names shard {file}, which is not in {index.parent}", "download every shard")
        found = read(shard)
        lost = [n for n in names if n not in found]
        if lost:
            raise _fail(shard, f"lacks {', '.join(lost[:4])}, which the index places there", "download it again")
        entries.update({n: found[n] for n in names})
    return entries


def open_weights(source: str | Path) -> Weights:
    """A safetensors file, a ``.bin`` / ``.pt`` file, or a Hugging Face model directory
    (``model.safetensors[.index.json]`` or ``pytorch_model.bin[.index.json]``)."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{path} does not exist", source=path, key="source",
                          fix="pass a safetensors file, a Hugging Face model directory, or a checkpoint directory")
    if path.is_dir():
        for name in HF_FILES:
            candidate = path / name
            if candidate.is_file():
                path = candidate
                break
        else:
            raise _fail(path, f"holds none of {', '.join(HF_FILES)}",
                        "pass a directory written by save_pretrained, or the weight file itself")
    if path.name.endswith(".index.json"):
        reader = read_safetensors_header if ".safetensors" in path.name else _pickled_entries
        return Weights(path, _from_index(path, reader))
    if path.suffix == ".safetensors":
        return Weights(path, read_safetensors_header(path))
    if path.suffix in (".bin", ".pt", ".pth"):
        return Weights(path, _pickled_entries(path))
    raise _fail(path, "is neither safetensors nor a torch.load file", "pass a .safetensors, .bin or .pt file")
