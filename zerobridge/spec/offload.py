"""Where optimizer state and parameters live: accelerator memory, host memory,
or files on NVMe. The two tiers are independent, as in DeepSpeed; FSDP can
only move parameters, gradients and the optimizer step to the host together.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from zerobridge.spec.base import SpecModel

__all__ = ["OffloadDevice", "OffloadSpec", "OffloadTier", "OptimizerOffload", "ParamOffload"]


class OffloadDevice(StrEnum):
    """Storage tier."""

    NONE = "none"
    """Accelerator memory (no offload)."""
    CPU = "cpu"
    """Host memory; the optimizer step runs on the host."""
    NVME = "nvme"
    """Files under ``nvme_path``, streamed through host buffers."""


class OffloadTier(SpecModel):
    """Settings shared by both offload tiers."""

    device: OffloadDevice = OffloadDevice.NONE
    """Where the states of this tier live."""
    nvme_path: str | None = None
    """Directory for the swap files; required when ``device`` is ``nvme``."""
    pin_memory: bool = True
    """Use page-locked host buffers for faster transfers."""
    buffer_count: int = Field(default=4, ge=1)
    """Host buffers used to stream NVMe swap files."""

    @model_validator(mode="after")
    def _check_path(self) -> OffloadTier:
        if self.device is OffloadDevice.NVME and not self.nvme_path:
            raise ValueError("device='nvme' needs nvme_path: the directory for the swap files")
        return self

    @property
    def enabled(self) -> bool:
        """Whether this tier moves states off the accelerator."""
        return self.device is not OffloadDevice.NONE


class OptimizerOffload(OffloadTier):
    """Optimizer-state tier (optimizer moments and master weights)."""

    ratio: float = Field(default=1.0, gt=0.0, le=1.0)
    """Fraction of the optimizer state (and step) that is offloaded; below 1.0
    needs sharded parameters (ZeRO-3 partial offload)."""
    pipeline_read: bool = False
    """Overlap NVMe reads with the tiled optimizer step."""
    pipeline_write: bool = False
    """Overlap NVMe writes with the tiled optimizer step."""


class ParamOffload(OffloadTier):
    """Parameter tier (sharded parameters only)."""

    buffer_count: int = Field(default=5, ge=1)
    """Host buffers used to stream NVMe swap files."""
    buffer_size: int = Field(default=100_000_000, ge=1)
    """Elements per NVMe swap buffer."""
    max_in_cpu: int = Field(default=1_000_000_000, ge=0)
    """Most parameter elements kept in host memory when the tier is NVMe."""


class OffloadSpec(SpecModel):
    """The two independent offload tiers."""

    optimizer: OptimizerOffload = OptimizerOffload()
    """Where optimizer state and master weights live."""
    parameters: ParamOffload = ParamOffload()
    """Where sharded parameters live; only meaningful when parameters are
    sharded at rest."""
    sub_group_size: int = Field(default=1_000_000_000, ge=0)
    """Elements per tile of the offloaded optimizer step: only one tile's state
    is in host memory at once when streaming from NVMe."""
