"""Offload tiers: where master values, optimizer state and parameter shards
live, and the swap files behind the nvme tier.

    >>> import tempfile, torch
    >>> from zerobridge.engine.offload import SwapSpace
    >>> space = SwapSpace(tempfile.mkdtemp(), rank=0, label="optimizer")
    >>> region = space.allocate(4, torch.bfloat16)            # 4 elements in this rank's swap file
    >>> region.write(1, torch.tensor([1.5, 2.5], dtype=torch.bfloat16))
    >>> out = torch.zeros(2, dtype=torch.bfloat16)
    >>> region.read(1, out).tolist(), space.used_bytes
    ([1.5, 2.5], 8)
    >>> space.close(); space.path.exists()
    False

The two tiers of the spec are independent. The *optimizer* tier holds the
master values (when they are a separate copy) and the optimizer state; the
*parameter* tier holds the compute shards of groups sharded at rest (stage
3). Each tier resolves to a ``Home``: ``none`` is the device; ``cpu`` is host
memory, which on a machine without an accelerator *is* the device, so there
it changes no tensor (only ``zerobridge.stats`` counts the bytes as host);
``nvme`` is a file in a per-process directory under ``nvme_path``, removed
when the engine is garbage collected or the process exits, and by the next
``prepare`` on the same host if the process died.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from zerobridge.errors import ConfigError
from zerobridge.spec import OffloadDevice, OffloadSpec

__all__ = ["FileRegion", "Home", "HostRegion", "OffloadPlan", "Placement", "Region", "Spaces", "SwapSpace",
           "check_offload", "open_spaces", "place", "placeholder", "plan_offload", "release", "remove_stale",
           "reserve"]

PREFIX = "zerobridge-swap-"
_NAME = re.compile(rf"^{PREFIX}[a-z]+-(?P<host>.+)-(?P<pid>\d+)-r\d+-[0-9a-f]+$")
_ALIGN = 64


class Home(Enum):
    """Where a tensor's bytes are between uses."""

    DEVICE = "device"
    """The compute device (the accelerator; on a CPU machine, memory)."""
    HOST = "host"
    """Host memory apart from the accelerator (the cpu tier on an accelerator)."""
    FILE = "file"
    """A swap file (the nvme tier)."""


@dataclass(frozen=True)
class Placement:
    """A tier as the spec names it and the home it resolves to here."""

    tier: OffloadDevice
    home: Home

    @property
    def resident_label(self) -> str:
        """The ``tier_bytes`` key for bytes of this tier held in memory."""
        return "device" if self.tier is OffloadDevice.NONE else "host"


ON_DEVICE = Placement(OffloadDevice.NONE, Home.DEVICE)


@dataclass(frozen=True)
class OffloadPlan:
    """The offload fields of a spec resolved for one engine."""

    optimizer: Placement = ON_DEVICE
    parameters: Placement = ON_DEVICE
    optimizer_path: str | None = None
    parameters_path: str | None = None
    sub_group_size: int = 1_000_000_000
    """Most elements per tile of the streamed step (a larger parameter is a tile alone)."""
    pipeline_read: bool = False
    pipeline_write: bool = False
    pin_memory: bool = True
    """Host copies of the cpu tier are page-locked (only with an accelerator)."""


def _placement(tier: OffloadDevice, accelerator: bool) -> Placement:
    if tier is OffloadDevice.NVME:
        return Placement(tier, Home.FILE)
    if tier is OffloadDevice.CPU and accelerator:
        return Placement(tier, Home.HOST)
    return Placement(tier, Home.DEVICE)


def check_swap_path(path: str | None, key: str) -> None:
    """``ConfigError`` unless ``path`` is an existing directory this process can write."""
    where = Path(path or "").expanduser()
    if not path or not where.exists():
        raise ConfigError(f"nvme_path {path!r} does not exist", key=key,
                          fix="create the directory first (mkdir -p), or point nvme_path at a directory on a local disk")
    if not where.is_dir():
        raise ConfigError(f"nvme_path {path!r} is not a directory", key=key, fix="point nvme_path at a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".zerobridge-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"nvme_path {path!r} is not writable ({exc.strerror})", key=key,
                          fix="choose a directory this user can create files in, or fix its permissions") from None


def check_offload(spec: OffloadSpec, *, sharded_at_rest: bool) -> None:
    """``ConfigError`` for offload settings the engine cannot run (paths included)."""
    if spec.optimizer.ratio < 1.0:
        raise ConfigError(f"offload.optimizer.ratio={spec.optimizer.ratio}: the native engine offloads all of the "
                          "optimizer state or none of it", key="offload.optimizer.ratio",
                          fix="set offload.optimizer.ratio = 1.0")
    if spec.parameters.enabled and not sharded_at_rest:
        raise ConfigError(f"offload.parameters.device={spec.parameters.device.value!r} needs parameters sharded at "
                          "rest (stage 3): at stages 0-2 every rank uses all of them in every step",
                          key="offload.parameters.device",
                          fix="use stage 3 (sharding.parameters = reshard_after_forward), or set "
                              "offload.parameters.device = 'none'")
    for name in ("optimizer", "parameters"):
        tier = getattr(spec, name)
        if tier.device is OffloadDevice.NVME:
            check_swap_path(tier.nvme_path, f"offload.{name}.nvme_path")


def plan_offload(spec: OffloadSpec, *, sharded_at_rest: bool, accelerator: bool) -> OffloadPlan:
    """Resolve the offload fields; ``accelerator``: the model lives on one (cpu tiers then copy)."""
    check_offload(spec, sharded_at_rest=sharded_at_rest)
    return OffloadPlan(optimizer=_placement(spec.optimizer.device, accelerator),
                       parameters=_placement(spec.parameters.device, accelerator),
                       optimizer_path=spec.optimizer.nvme_path, parameters_path=spec.parameters.nvme_path,
                       sub_group_size=spec.sub_group_size, pipeline_read=spec.optimizer.pipeline_read,
                       pipeline_write=spec.optimizer.pipeline_write,
                       pin_memory=spec.optimizer.pin_memory and spec.parameters.pin_memory)


# ---------------------------------------------------------------------- swap directories


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
        try:
            os.close(fd)
        except OSError:
            pass
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


def host_tensor(values: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A host copy of ``values``; page-locked when asked and an accelerator can use it."""
    host = values.detach().to("cpu", copy=True)
    return host.pin_memory() if pin and torch.cuda.is_available() else host


def place(at: Placement, values: torch.Tensor, space: SwapSpace | None, *, pin: bool) -> Region | None:
    """Move ``values`` to the home ``at`` names: a file region of ``space``, a host
    tensor, or ``None`` (the device: they stay where they are)."""
    if at.home is Home.HOST:
        return HostRegion(host_tensor(values, pin=pin))
    if at.home is Home.FILE:
        assert space is not None, "an nvme tier needs its swap space"
        region = space.allocate(values.numel(), values.dtype)
        region.write(0, values)
        return region
    return None


class Spaces(NamedTuple):
    """The swap spaces of one engine (``None``: that tier is not nvme)."""

    optimizer: SwapSpace | None
    parameters: SwapSpace | None


def open_spaces(plan: OffloadPlan, *, rank: int) -> Spaces:
    """Create this process's swap directories for the nvme tiers of ``plan``."""
    def space(placement: Placement, path: str | None, label: str) -> SwapSpace | None:
        if placement.home is not Home.FILE:
            return None
        assert path is not None
        return SwapSpace(path, rank=rank, label=label)
    return Spaces(space(plan.optimizer, plan.optimizer_path, "optimizer"),
                  space(plan.parameters, plan.parameters_path, "parameters"))


def reserve(tensor: torch.Tensor) -> None:
    """Give ``tensor`` (a whole storage) its memory back (contents undefined)."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def release(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s memory; views keep their shape (never read them until ``reserve``)."""
    tensor.untyped_storage().resize_(0)


def placeholder(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a parameter holds while its values are in a file: the right shape, one
    NaN seen through stride 0 (reads give NaN; in-place writes raise)."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)
