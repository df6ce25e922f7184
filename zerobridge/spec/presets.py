"""The spec a bare ZeRO stage number means: what ``prepare(model, stage=N)`` and ``zerobridge run --stage N`` run.

    >>> from zerobridge.spec.presets import spec_for_stage
    >>> spec = spec_for_stage(3)
    >>> spec.sharding.stage.value, spec.wrapping.policy, spec.communication.prefetch_bucket
    (3, 'every_module', 'per_unit')
    >>> spec_for_stage(1).batch.grad_sync.value
    'accumulation_boundary'

Torch-free: ``model`` is only asked whether it names its layers
(``_no_split_modules``, as Hugging Face models do).
"""

from __future__ import annotations

from zerobridge.errors import ConfigError
from zerobridge.spec.batch import BatchSpec, GradSync
from zerobridge.spec.communication import CommunicationSpec
from zerobridge.spec.sharding import ShardingSpec
from zerobridge.spec.strategy import StrategySpec
from zerobridge.spec.wrapping import EveryModuleWrap, RootWrap, TransformerWrap, WrapSpec

__all__ = ["STAGES", "spec_for_stage"]

STAGES = (0, 1, 2, 3)
"""DeepSpeed's ZeRO stages."""


def spec_for_stage(stage: int, model: object | None = None) -> StrategySpec:
    """DeepSpeed's ZeRO ``stage`` with the spec's defaults.

    Stages 0 and 1 reduce at the accumulation boundary only (as DeepSpeed
    does). Stage 3 is cut into one unit per transformer layer when the model
    names its layers (``_no_split_modules``), else one per module with
    parameters (DeepSpeed's fetching scheme), and prefetches one unit ahead as
    FSDP2 does: DeepSpeed's 5e7-element prefetch bucket would gather every unit
    of a model smaller than that at the start of backward, with no ZeRO-3
    saving left (a DeepSpeed config keeps its own bucket).

    Args:
        stage: 0, 1, 2 or 3.
        model: the model to be prepared, if known (only ``_no_split_modules`` is read).
    """
    if stage not in STAGES:
        raise ConfigError(f"stage={stage!r} is not a ZeRO stage", key="stage", fix="choose 0, 1, 2 or 3")
    sync = GradSync.ACCUMULATION_BOUNDARY if stage <= 1 else GradSync.EVERY_MICRO_STEP
    wrap: WrapSpec = RootWrap()
    communication = CommunicationSpec()
    if stage == 3:
        wrap = TransformerWrap() if getattr(model, "_no_split_modules", None) else EveryModuleWrap()
        communication = CommunicationSpec(prefetch_bucket="per_unit")
    return StrategySpec(name=f"stage{stage}", sharding=ShardingSpec.for_stage(stage),
                        batch=BatchSpec(grad_sync=sync), wrapping=wrap, communication=communication)
