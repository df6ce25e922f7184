"""The partitioning spec: frozen pydantic models, one per concern.

    >>> from zerobridge.spec import StrategySpec, ShardingSpec, Stage
    >>> StrategySpec(sharding=ShardingSpec.for_stage(Stage.GRADIENTS)).summary()
    'stage 2, params replicated, compute fp32'
"""

from zerobridge.spec.base import AUTO, Auto, DType, SpecModel, is_auto
from zerobridge.spec.batch import BatchSpec, GradSync
from zerobridge.spec.checkpoint import CheckpointFormat, CheckpointSpec
from zerobridge.spec.communication import BackwardPrefetch, Bucket, CommunicationSpec
from zerobridge.spec.compilation import CompileMode, CompileScope, CompileSpec
from zerobridge.spec.offload import OffloadDevice, OffloadSpec, OffloadTier, OptimizerOffload, ParamOffload
from zerobridge.spec.precision import DynamicLossScale, LossScaling, NoLossScale, PrecisionSpec, StaticLossScale
from zerobridge.spec.sharding import GroupSize, ShardingSpec
from zerobridge.spec.stage import STAGE_SHARDS, ParamSharding, Stage, StageShards
from zerobridge.spec.strategy import StrategySpec
from zerobridge.spec.wire import WireFormat, WireSpec
from zerobridge.spec.wrapping import EveryModuleWrap, RootWrap, SizeWrap, TransformerWrap, WrapSpec

__all__ = [
    "AUTO", "Auto", "BackwardPrefetch", "BatchSpec", "Bucket", "CheckpointFormat", "CheckpointSpec",
    "CommunicationSpec", "CompileMode", "CompileScope", "CompileSpec", "DType", "DynamicLossScale", "EveryModuleWrap",
    "GradSync", "GroupSize",
    "LossScaling", "NoLossScale", "OffloadDevice", "OffloadSpec", "OffloadTier", "OptimizerOffload",
    "ParamOffload", "ParamSharding", "PrecisionSpec", "RootWrap", "STAGE_SHARDS", "ShardingSpec",
    "SizeWrap", "SpecModel", "Stage", "StageShards", "StaticLossScale", "StrategySpec",
    "TransformerWrap", "WireFormat", "WireSpec", "WrapSpec", "is_auto",
]
