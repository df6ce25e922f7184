"""DeepSpeed's and Accelerate's own memory estimators, as the benchmarks set them beside the plan and real runs.

    >>> from zerobridge.testing.estimators import deepspeed_estimate
    >>> deepspeed_estimate(1, params=10**6, largest=10**5, world_size=2) is None   # DeepSpeed has none for stage 1
    True

``deepspeed_estimate``: ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``,
their per-GPU figure, for ``world_size`` GPUs on one node without offload (DeepSpeed has no estimator for stages 0
and 1). ``accelerate_estimate``: the training figure of ``accelerate estimate-memory`` (``estimate_training_usage``)
for the model's fp32 bytes in the run's dtype; it does not know the world size or the sharding. Both count model
states (and Accelerate a flat factor for the rest), not activations; ``bench/plan.py`` and ``bench/plan_flavors.py``
show their errors against the same measured peaks as the plan's.
"""

from __future__ import annotations

from torch import nn

__all__ = ["accelerate_estimate", "deepspeed_estimate", "estimator_sizes"]


def estimator_sizes(model: nn.Module) -> tuple[int, int]:
    """What the estimators take of ``model``: its parameter count and the largest layer's own parameters."""
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return params, largest


def deepspeed_estimate(stage: int, *, params: int, largest: int, world_size: int) -> int | None:
    """DeepSpeed's per-GPU estimate for ``params`` parameters (``largest`` in the largest layer) at ``stage``."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # lazy: DeepSpeed

        return int(estimate_zero2_model_states_mem_needs(params, world_size, 1, cpu_offload=False)[1])
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return int(estimate_zero3_model_states_mem_needs(params, largest, world_size, 1, cpu_offload=False,
                                                         cpu_offload_params=False)[1])
    return None


def accelerate_estimate(params: int, precision: str) -> int:
    """``accelerate estimate-memory``'s training figure for ``params`` parameters trained in ``precision``."""
    from accelerate.commands.estimate import estimate_training_usage  # lazy: Accelerate

    usage = estimate_training_usage(params * 4, {"fp32": "float32", "bf16": "bfloat16"}[precision])
    return int(max(usage.values()))
