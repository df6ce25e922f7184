"""The swap files behind the nvme tier: one per process and tier, regions in it, and host regions beside them.

    >>> import tempfile, torch
    >>> from zerobridge.engine.swapfile import SwapSpace
    >>> space = SwapSpace(tempfile.mkdtemp(), rank=0, label="optimizer")
    >>> region = space.allocate(4, torch.bfloat16)            # 4 elements in this rank's swap file
    >>> region.write(1, torch.tensor([1.5, 2.5], dtype=torch.bfloat16))
    >>> out = torch.zeros(2, dtype=torch.bfloat16)
    >>> region.read(1, out).tolist(), space.used_bytes
    ([1.5, 2.5], 8)
    >>> space.close(); space.path.exists()
    False

A swap file lives in a per-process directory under ``nvme_path``, named for
the host and process; it is removed when its engine is garbage collected or
the process exits, and by the next ``prepare`` on the same host if the
process died (``remove_stale``). A ``Region`` is a run of elements in a
file (``FileRegion``: ``os.pread``/``os.pwrite`` on the file, no mmap) or in
a host tensor (``HostRegion``, the cpu tier on an accelerator).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import socket
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["FileRegion", "HostRegion", "Region", "SwapSpace", "reads_into_device", "remove_stale"]

PREFIX = "zerobridge-swap-"
_NAME = re.compile(rf"^{PREFIX}[a-z]+-(?P<host>.+)-(?P<pid>\d+)-r\d+-[0-9a-f]+$")
_ALIGN = 64


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(root: str | Path) -> list[Path]:
    """Remove swap directories under ``root`` left by dead processes of this host."""
    removed = []
    for entry in Path(root).expanduser().glob(PREFIX + "*"):
        match = _NAME.match(entry.name)
        if match and match["host"] == _host() and not _alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _tear_down(path: Path, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    shutil.rmtree(path, ignore_errors=True)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as writable bytes (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SwapSpace:
    """One process's directory of swap files under a tier's ``nvme_path``: one file,
    handed out in regions. Removed by ``close``, garbage collection or exit."""

    def __init__(self, root: str | Path, *, rank: int, label: str) -> None:
        remove_stale(root)
        name = f"{PREFIX}{label}-{_host()}-{os.getpid()}-r{rank}-{secrets.token_hex(4)}"
        self.path = Path(root).expanduser() / name
        self.path.mkdir()
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _tear_down, self.path, self._fds)
        self.fd = os.open(self.path / f"{label}.swp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fds.append(self.fd)
        self.size = 0
        self.used_bytes = 0
        """Bytes of the regions in use (what ``tier_bytes["nvme"]`` counts)."""

    def allocate(self, numel: int, dtype: torch.dtype) -> FileRegion:
        """A new region of ``numel`` elements (reads zeros until written)."""
        nbytes = numel * dtype.itemsize
        offset = self.size
        self.size += -(-nbytes // _ALIGN) * _ALIGN
        os.ftruncate(self.fd, self.size)
        self.used_bytes += nbytes
        return FileRegion(self, offset, numel, dtype)

    def release(self, region: FileRegion) -> None:
        """Stop counting a region (its bytes stay in the file until close)."""
        self.used_bytes -= region.nbytes

    def close(self) -> None:
        """Close the file and remove the directory now."""
        self._finalizer()


class Region(Protocol):
    """A tensor's elements kept away from the device: a file region or a host tensor."""

    @property
    def nbytes(self) -> int: ...
    def read(self, start: int, out: torch.Tensor) -> torch.Tensor: ...
    def write(self, start: int, values: torch.Tensor) -> None: ...


@dataclass(frozen=True, eq=False)
class FileRegion:
    """``numel`` elements of ``dtype`` at byte ``offset`` of a space's file."""

    space: SwapSpace
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def _at(self, start: int, count: int) -> int:
        if start < 0 or start + count > self.numel:
            raise IndexError(f"elements [{start}, {start + count}) outside a region of {self.numel}")
        return self.offset + start * self.dtype.itemsize

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` with elements ``[start, start + out.numel())``; return it."""
        position = self._at(start, out.numel())
        host = out if out.device.type == "cpu" and out.is_contiguous() and out.dtype == self.dtype else \
            torch.empty(out.numel(), dtype=self.dtype)
        view = _bytes_of(host) if host.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            got = os.preadv(self.space.fd, [view[done:]], position + done)
            if got == 0:
                raise OSError(f"swap file {self.space.path} ended early: was it removed or truncated?")
            done += got
        if host is not out:
            out.copy_(host.view(out.shape))
        return out

    def write(self, start: int, values: torch.Tensor) -> None:
        """Store ``values`` (any device, cast to the region's dtype) at element ``start``."""
        host = values.detach().reshape(-1).to("cpu", self.dtype).contiguous()
        position = self._at(start, host.numel())
        view = _bytes_of(host) if host.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            done += os.pwrite(self.space.fd, view[done:], position + done)


@dataclass(frozen=True, eq=False)
class HostRegion:
    """Elements kept in a host tensor (the cpu tier when the model is on an accelerator)."""

    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Copy elements into ``out``: without waiting from pinned memory to an accelerator
        (the copy is ordered on the current stream, the gather stream for a shard)."""
        values = self.tensor[start:start + out.numel()]
        out.view(-1).copy_(values, non_blocking=reads_into_device(out) and values.is_pinned())
        return out

    def write(self, start: int, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1)
        self.tensor[start:start + flat.numel()].copy_(flat)


def reads_into_device(out: torch.Tensor) -> bool:
    """Whether copying host memory into ``out`` crosses to an accelerator."""
    return out.device.type != "cpu"
