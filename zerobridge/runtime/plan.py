"""What every backend resolves from a spec the same way: dtypes, accumulation, clipping, loss scaling.

    >>> from zerobridge.runtime.plan import plan_run
    >>> from zerobridge.spec import BatchSpec, PrecisionSpec, StrategySpec
    >>> plan = plan_run(StrategySpec(precision=PrecisionSpec(param_dtype="bf16"),
    ...                              batch=BatchSpec(micro_batch_size=2, global_batch_size=16,
    ...                                            accumulation_steps="auto")), world_size=4)
    >>> plan.compute_dtype, plan.master_dtype, plan.accumulation_steps, plan.gradient_divisor
    (torch.bfloat16, torch.float32, 2, 8.0)

The native engine adds its own numbers on top (``engine/plan.py``: groups,
buckets, prefetch, offload tiers); torch FSDP2 and DeepSpeed run these rules
around their own engines, so a spec means the same step on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerobridge.spec import Auto, DType, GradSync, LossScaling, NoLossScale, StrategySpec, WrapSpec, is_auto

__all__ = ["TORCH_DTYPES", "RunPlan", "hidden_size", "plan_run", "run_fields"]

TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


@dataclass(frozen=True)
class RunPlan:
    """A spec's run rules resolved for one world size."""

    spec: StrategySpec
    world_size: int
    compute_dtype: torch.dtype
    """What forward and backward compute in (``precision.param_dtype``; ``auto``: fp32)."""
    master_dtype: torch.dtype
    """What the optimizer steps (the compute dtype when that is fp32)."""
    reduce_dtype: torch.dtype
    accumulate_dtype: torch.dtype
    buffer_dtype: torch.dtype | None
    accumulation_steps: int
    """Micro-batches per optimizer step (``BatchSpec.accumulation_for``)."""
    grad_sync: GradSync
    clip_grad_norm: float | None
    """The spec's clipping, applied at step time (``None``: none, or left to the loop)."""
    loss_scaling: LossScaling
    """fp16 only: other dtypes run ``NoLossScale``."""
    skip_nonfinite_steps: bool
    activation_checkpointing: bool
    wrap: WrapSpec

    @property
    def gradient_divisor(self) -> float:
        """Gradients are averaged over ranks and (DeepSpeed's rule) accumulation steps."""
        return float(self.world_size * self.accumulation_steps)


def _dtype(value: DType | Auto, fallback: DType) -> torch.dtype:
    return TORCH_DTYPES[fallback if is_auto(value) else DType(value)]


def plan_run(spec: StrategySpec, *, world_size: int) -> RunPlan:
    """Resolve ``spec``'s run rules on ``world_size`` ranks; ``ConfigError`` when the batch
    arithmetic or the spec's own world size does not fit."""
    precision, batch = spec.precision, spec.batch
    spec.sharding.check_world(world_size)
    compute_name = DType.FP32 if is_auto(precision.param_dtype) else DType(precision.param_dtype)
    compute = TORCH_DTYPES[compute_name]
    clip = batch.clip_grad_norm
    return RunPlan(
        spec=spec, world_size=world_size, compute_dtype=compute,
        master_dtype=TORCH_DTYPES[precision.master_dtype] if compute != torch.float32 else compute,
        reduce_dtype=_dtype(precision.reduce_dtype, compute_name),
        accumulate_dtype=_dtype(precision.accumulate_dtype, compute_name),
        buffer_dtype=TORCH_DTYPES[precision.buffer_dtype] if precision.buffer_dtype else None,
        accumulation_steps=batch.accumulation_for(world_size), grad_sync=batch.grad_sync,
        clip_grad_norm=None if clip is None or is_auto(clip) else float(clip),
        loss_scaling=precision.loss_scaling if compute == torch.float16 else NoLossScale(),
        skip_nonfinite_steps=precision.skip_nonfinite_steps,
        activation_checkpointing=spec.checkpoint.activation_checkpointing, wrap=spec.wrapping)


def run_fields(plan: RunPlan) -> dict[str, object]:
    """``plan``'s fields by name, to build a plan that extends it (``engine.plan.EnginePlan``)."""
    return {name: getattr(plan, name) for name in RunPlan.__dataclass_fields__}


def hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size, for ``"auto"`` bucket sizes and the DeepSpeed reduce bucket written for a
    known model (``runtime/wrap_units.bucket_sizes``), read as HF Trainer reads it: ``config.hidden_size``
    (or another name for it), else the largest of ``config.hidden_sizes``; ``None`` without one.

        >>> from zerobridge.models import tiny_gpt
        >>> hidden_size(tiny_gpt("tiny")), hidden_size(nn.Linear(2, 2))
        (64, None)
    """
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    sizes = getattr(config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(v, int) and v > 0 for v in sizes):
        return int(max(sizes))
    return None
