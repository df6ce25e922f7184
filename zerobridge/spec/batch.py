"""Batch arithmetic, gradient accumulation and clipping.

DeepSpeed's identity: global batch = micro batch x accumulation steps x
data-parallel size. The spec checks the part it can without knowing the world
size, and ``resolve_global_batch`` the rest; ``accumulation_for`` gives the
accumulation steps every backend runs at a world size.

    >>> from zerobridge.spec import BatchSpec
    >>> BatchSpec(micro_batch_size=2, global_batch_size=16, accumulation_steps="auto").accumulation_for(4)
    2
    >>> BatchSpec().accumulation_for(4)
    1
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from zerobridge.errors import ConfigError
from zerobridge.spec.base import Auto, SpecModel

__all__ = ["BatchSpec", "GradSync"]

PositiveInt = Annotated[int, Field(ge=1)]


class GradSync(StrEnum):
    """When gradients are communicated under gradient accumulation."""

    EVERY_MICRO_STEP = "every_micro_step"
    """Reduced after every micro-batch into the (sharded) accumulator
    (ZeRO-2/3)."""
    ACCUMULATION_BOUNDARY = "accumulation_boundary"
    """Accumulated locally and reduced once per optimizer step (ZeRO-0/1, FSDP
    ``no_sync()`` / ``set_requires_gradient_sync(False)``)."""


class BatchSpec(SpecModel):
    """Micro batch, accumulation, global batch and clipping."""

    micro_batch_size: PositiveInt | Auto | None = None
    """Samples per rank per forward; ``None``: set by the training loop."""
    accumulation_steps: PositiveInt | Auto | None = 1
    """Micro-batches per optimizer step; ``None``: derived at run time as
    global / (micro x data-parallel size), as DeepSpeed does."""
    global_batch_size: PositiveInt | Auto | None = None
    """Samples per optimizer step over all data-parallel ranks."""
    grad_sync: GradSync = GradSync.EVERY_MICRO_STEP
    """When gradients are communicated under accumulation."""
    clip_grad_norm: Annotated[float, Field(ge=0)] | Auto | None = None
    """Clip the global gradient 2-norm to this value; ``None``: no clipping."""

    @model_validator(mode="after")
    def _check(self) -> BatchSpec:
        per_rank = self.per_rank_batch
        if per_rank is not None and isinstance(self.global_batch_size, int) and self.global_batch_size % per_rank:
            raise ValueError(
                f"batch.global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size x accumulation_steps = {self.micro_batch_size} x "
                f"{self.accumulation_steps} = {per_rank}: global = micro x accumulation x "
                "data-parallel size"
            )
        micro = self.micro_batch_size
        if per_rank is None and isinstance(micro, int) and isinstance(self.global_batch_size, int) \
                and self.global_batch_size % micro:
            raise ValueError(
                f"batch.global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size={micro}: "
                "global = micro x accumulation x data-parallel size"
            )
        return self

    @property
    def per_rank_batch(self) -> int | None:
        """micro x accumulation, when both are known numbers."""
        if isinstance(self.micro_batch_size, int) and isinstance(self.accumulation_steps, int):
            return self.micro_batch_size * self.accumulation_steps
        return None

    def resolve_global_batch(self, world_size: int) -> int | None:
        """The global batch at ``world_size``, checking DeepSpeed's identity."""
        per_rank = self.per_rank_batch
        if per_rank is None:
            return self.global_batch_size if isinstance(self.global_batch_size, int) else None
        expected = per_rank * world_size
        if isinstance(self.global_batch_size, int) and self.global_batch_size != expected:
            raise ValueError(
                f"batch.global_batch_size={self.global_batch_size} but micro x accumulation x "
                f"world = {self.micro_batch_size} x {self.accumulation_steps} x {world_size} = "
                f"{expected}: fix one of the three, or run on "
                f"{self.global_batch_size // per_rank} ranks"
            )
        return expected

    def accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks: ``accumulation_steps`` when it
        is a number, else global / (micro x world) when both are numbers, else 1. ``ConfigError``
        when the global batch is below one micro-batch per rank or breaks DeepSpeed's identity."""
        steps = self.accumulation_steps
        if not isinstance(steps, int):
            micro, glob = self.micro_batch_size, self.global_batch_size
            steps = glob // (micro * world_size) if isinstance(glob, int) and isinstance(micro, int) else 1
            if steps < 1:
                raise ConfigError(f"batch.global_batch_size={glob} is smaller than micro x world = {micro} x "
                                  f"{world_size}", key="batch.global_batch_size",
                                  fix="raise the global batch or lower the micro batch")
        try:
            self.resolve_global_batch(world_size)
        except ValueError as exc:
            raise ConfigError(str(exc), key="batch.global_batch_size",
                              fix="make global = micro x accumulation x world") from None
        return steps
