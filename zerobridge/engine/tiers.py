"""Offload tiers: where master values, optimizer state and parameter shards live.

    >>> import torch
    >>> from zerobridge.engine.tiers import Home, plan_offload
    >>> from zerobridge.spec import OffloadSpec
    >>> plan = plan_offload(OffloadSpec(optimizer={"device": "cpu"}), sharded_at_rest=False, accelerator=True)
    >>> plan.optimizer.home is Home.HOST, plan.parameters.home is Home.DEVICE
    (True, True)

The two tiers of the spec are independent. The *optimizer* tier holds the
master values (when they are a separate copy) and the optimizer state; the
*parameter* tier holds the compute shards of groups sharded at rest (stage
3). Each tier resolves to a ``Home``: ``none`` is the device; ``cpu`` is host
memory, which on a machine without an accelerator *is* the device, so there
it changes no tensor (only ``zerobridge.stats`` counts the bytes as host);
``nvme`` is a file in a per-process directory under ``nvme_path``, removed
when the engine is garbage collected or the process exits, and by the next
``prepare`` on the same host if the process died (``swapfile.py``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import NamedTuple

import torch

from zerobridge.engine.swapfile import HostRegion, Region, SwapSpace
from zerobridge.errors import ConfigError
from zerobridge.spec import OffloadDevice, OffloadSpec

__all__ = ["Home", "OffloadPlan", "Placement", "Spaces", "check_offload", "host_tensor", "open_spaces", "place",
           "placeholder", "plan_offload", "release", "reserve"]


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
                          fix="create the directory first (mkdir -p), or point nvme_path at a directory on a "
                              "local disk")
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
