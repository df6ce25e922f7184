"""The partitioning spec: one model that states any ZeRO or FSDP strategy.

    >>> from zerobridge.spec import StrategySpec, ShardingSpec
    >>> spec = StrategySpec(sharding=ShardingSpec.for_stage(3))
    >>> spec.sharding.stage.name
    'PARAMETERS'
    >>> StrategySpec.model_validate({"sharding": {"optimizer_state": True}}).sharding.stage.value
    1
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, JsonValue, model_validator

from zerobridge.spec.base import SpecModel
from zerobridge.spec.batch import BatchSpec
from zerobridge.spec.checkpoint import CheckpointSpec
from zerobridge.spec.communication import CommunicationSpec
from zerobridge.spec.compilation import CompileSpec
from zerobridge.spec.offload import OffloadDevice, OffloadSpec
from zerobridge.spec.precision import PrecisionSpec
from zerobridge.spec.sharding import ShardingSpec
from zerobridge.spec.wire import WireFormat
from zerobridge.spec.wrapping import RootWrap, WrapSpec

__all__ = ["StrategySpec"]


class StrategySpec(SpecModel):
    """A complete partitioning strategy, independent of DeepSpeed and FSDP."""

    name: str | None = None
    """Registry name, when the spec came from the registry."""
    sharding: ShardingSpec = ShardingSpec()
    """What is sharded, when parameters are gathered, over which group."""
    offload: OffloadSpec = OffloadSpec()
    """Where optimizer state and parameters live."""
    precision: PrecisionSpec = PrecisionSpec()
    """Compute, master, reduce and accumulation dtypes; loss scaling."""
    communication: CommunicationSpec = CommunicationSpec()
    """Buckets, overlap, prefetch, persistence."""
    wrapping: WrapSpec = Field(default_factory=RootWrap)
    """How the model is cut into gather/reduce units."""
    batch: BatchSpec = BatchSpec()
    """Micro batch, accumulation, global batch, clipping."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Checkpoint layout and activation checkpointing."""
    compile: CompileSpec = CompileSpec()
    """Whether and how ``torch.compile`` runs the model's units."""
    passthrough: dict[str, dict[str, JsonValue]] = Field(default_factory=dict)
    """Settings of a source format that are not about sharding (optimizer,
    scheduler, logging, ...), kept verbatim per format so that converting back
    restores them. The engine does not read them."""

    @model_validator(mode="after")
    def _check(self) -> StrategySpec:
        sharding, offload = self.sharding, self.offload
        if offload.parameters.enabled and not sharding.parameters.sharded_at_rest:
            raise ValueError(
                f"offload.parameters.device={offload.parameters.device.value!r} needs parameters "
                "sharded at rest (sharding.parameters='reshard_after_forward' or "
                "'reshard_after_backward'); replicated parameters cannot be offloaded"
            )
        if offload.optimizer.enabled and not sharding.optimizer_state:
            raise ValueError(
                f"offload.optimizer.device={offload.optimizer.device.value!r} needs "
                "sharding.optimizer_state=true (ZeRO stage 1 or higher)"
            )
        if offload.optimizer.ratio < 1.0 and not sharding.parameters.sharded_at_rest:
            raise ValueError(
                f"offload.optimizer.ratio={offload.optimizer.ratio} (partial offload) needs "
                "parameters sharded at rest (ZeRO-3); use ratio=1.0"
            )
        if offload.optimizer.device is OffloadDevice.NONE and offload.optimizer.ratio < 1.0:
            raise ValueError("offload.optimizer.ratio < 1 needs offload.optimizer.device 'cpu' or 'nvme'")
        wire = self.communication.wire
        if wire.param_gather is not WireFormat.FULL and not sharding.parameters.sharded_at_rest:
            raise ValueError(
                f"communication.wire.param_gather={wire.param_gather.value!r} quantizes the all-gathers of "
                "parameters sharded at rest, and this stage keeps them whole (ZeRO-0/1/2 gather nothing before "
                "compute): use ZeRO-3 (sharding.parameters='reshard_after_forward'), or param_gather 'full'")
        if wire.frozen_weights is not WireFormat.FULL and not sharding.parameters.sharded_at_rest:
            raise ValueError(
                f"communication.wire.frozen_weights={wire.frozen_weights.value!r} stores frozen shards quantized "
                "and decodes them at each gather: it needs ZeRO-3, or frozen_weights 'full'")
        if wire.grad_reduce is not WireFormat.FULL and not sharding.gradients:
            raise ValueError(
                f"communication.wire.grad_reduce={wire.grad_reduce.value!r} quantizes the gradient "
                "reduce-scatter, and this stage all-reduces whole gradients: use ZeRO-2 or 3 "
                "(sharding.gradients=true), or grad_reduce 'full'")
        return self

    @property
    def gathers_compute_copy(self) -> bool:
        """Whether parameters sharded at rest keep FSDP's layout (``precision.compute_copy``
        ``"gathered"``: the fp32 shard is the master, the 16-bit copy cast at each gather).
        Only with mixed precision and no offload tier: a tier keeps the shard and the master
        apart, DeepSpeed's way. The engine and ``explain`` both follow this."""
        p, o = self.precision, self.offload
        return p.mixed and p.compute_copy == "gathered" and not o.optimizer.enabled and not o.parameters.enabled

    def summary(self) -> str:
        """One line: stage, parameter timing, group, offload, compute dtype."""
        s = self.sharding
        parts = [f"stage {s.stage.value}", f"params {s.parameters.value}"]
        if s.is_hybrid:
            parts.append(f"shard group {s.shard_group}")
        if s.backward_gather_group is not None:
            parts.append(f"backward gather group {s.backward_gather_group}")
        o = self.offload
        if o.optimizer.enabled or o.parameters.enabled:
            parts.append(f"offload optimizer={o.optimizer.device.value} params={o.parameters.device.value}")
        parts.append(f"compute {self.precision.param_dtype}")
        if self.compile.enabled:
            parts.append(f"compiled ({self.compile.scope.value}, {self.compile.backend})")
        return ", ".join(parts)

    def dump(self) -> dict[str, Any]:
        """The spec as JSON-compatible data, every field stated."""
        return self.model_dump(mode="json")
