"""Numeric formats: what the forward runs in, what the optimizer steps on,
what gradients travel and accumulate in, and how fp16 loss scaling behaves.

DeepSpeed keeps fp32 master weights apart from 16-bit compute weights; FSDP
steps the parameters in whatever dtype they were loaded with. Both are a value
of ``master_dtype`` here. Where the 16-bit copy lives when the master is fp32
is ``compute_copy``: stored beside the master (DeepSpeed), or made from the
fp32 shard at each gather and freed with it (FSDP).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from zerobridge.spec.base import Auto, DType, SpecModel, is_auto

__all__ = ["ComputeCopy", "DynamicLossScale", "LossScaling", "NoLossScale", "PrecisionSpec", "StaticLossScale"]

ComputeCopy = Literal["stored", "gathered"]
"""Where the 16-bit compute copy of fp32-master parameters lives (``PrecisionSpec.compute_copy``)."""


class NoLossScale(SpecModel):
    """No loss scaling."""

    kind: Literal["none"] = "none"
    """Discriminator."""


class StaticLossScale(SpecModel):
    """A fixed loss scale."""

    kind: Literal["static"] = "static"
    """Discriminator."""
    scale: float = Field(gt=0)
    """Multiplier applied to the loss before backward."""


class DynamicLossScale(SpecModel):
    """A loss scale that backs off on overflow and grows after clean windows."""

    kind: Literal["dynamic"] = "dynamic"
    """Discriminator."""
    initial_scale: float = Field(default=2.0**16, gt=0)
    """Scale at the first step."""
    growth_interval: int = Field(default=1000, ge=1)
    """Steps without overflow before the scale grows (DeepSpeed
    ``loss_scale_window`` 1000; torch GradScaler ``growth_interval`` 2000)."""
    growth_factor: float = Field(default=2.0, gt=1.0)
    """Multiplier when the scale grows."""
    backoff_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiplier when an overflow lowers the scale."""
    hysteresis: int = Field(default=2, ge=1)
    """Overflows tolerated before the scale is lowered (torch: 1)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow."""
    min_scale: float = Field(default=1.0, ge=0)
    """Floor for the scale (torch: 0, none)."""


LossScaling = Annotated[NoLossScale | StaticLossScale | DynamicLossScale, Field(discriminator="kind")]


class PrecisionSpec(SpecModel):
    """Dtypes of compute, master weights, reduction and accumulation."""

    param_dtype: DType | Auto = DType.FP32
    """Compute dtype: parameters are cast (or gathered) in it for forward and
    backward. ``auto``: the launcher's mixed-precision flag decides."""
    master_dtype: DType = DType.FP32
    """Dtype of the weights the optimizer steps and of its state. fp32 with a
    16-bit ``param_dtype`` is DeepSpeed's master-weight scheme; equal to
    ``param_dtype`` is FSDP training in the dtype the model was loaded in."""
    auto_choices: tuple[DType, ...] = (DType.BF16, DType.FP16)
    """With ``param_dtype = "auto"``: the 16-bit dtypes the launcher may switch on
    (HF Trainer's ``--bf16`` / ``--fp16`` fill only the sections that say
    ``"auto"``), besides fp32. Ignored, and kept at its default, otherwise."""
    reduce_dtype: DType | Auto = DType.FP32
    """Dtype gradients are reduced in. When not given: the compute dtype (the
    default of DeepSpeed and of FSDP alike)."""
    accumulate_dtype: DType | Auto = DType.FP32
    """Dtype gradients are accumulated in across micro-batches. When not given:
    the compute dtype (DeepSpeed's default)."""
    compute_copy: ComputeCopy = "stored"
    """With a 16-bit ``param_dtype`` and an fp32 ``master_dtype``: where the
    16-bit copy of the parameters lives. ``stored`` (DeepSpeed): kept at rest,
    sharded as the parameters are, beside a separate fp32 master sharded with
    the optimizer state; gradients are kept in ``accumulate_dtype`` and handed
    to the optimizer in fp32 only at the step. ``gathered`` (FSDP): the fp32
    parameters are the master, sharded as the parameters are, and the 16-bit
    copy is cast from them when a unit is gathered and freed with it. Without
    mixed precision there is one copy and the field is ``stored``."""
    buffer_dtype: DType | None = None
    """Dtype of module buffers; ``None`` keeps the dtype they were created in."""
    loss_scaling: LossScaling = NoLossScale()
    """fp16 loss scaling; only used when the compute dtype is fp16."""
    skip_nonfinite_steps: bool = False
    """Skip the optimizer step when any gradient is inf or nan (DeepSpeed does
    for fp16 always and, since 0.19.3, for bf16 too; FSDP does not)."""

    @model_validator(mode="before")
    @classmethod
    def _default_to_compute_dtype(cls, data: Any) -> Any:
        # Canonical form: the two dtypes that default to the compute dtype are
        # always stated, so equal runs give equal specs.
        if isinstance(data, dict):
            data = dict(data)
            compute = data.get("param_dtype", DType.FP32)
            for name in ("reduce_dtype", "accumulate_dtype"):
                if data.get(name) is None:
                    data[name] = compute
            if not is_auto(compute):
                data.pop("auto_choices", None)
            if compute not in ("auto", DType.BF16, DType.FP16, "bf16", "fp16") or \
                    data.get("master_dtype", DType.FP32) not in (DType.FP32, "fp32"):
                data.pop("compute_copy", None)  # one copy: the field has no meaning
        return data

    @model_validator(mode="after")
    def _check(self) -> PrecisionSpec:
        if self.loss_scaling.kind != "none" and self.param_dtype not in (DType.FP16, "auto"):
            raise ValueError(
                f"precision.loss_scaling is {self.loss_scaling.kind!r} but param_dtype is "
                f"{self.param_dtype!s}: loss scaling only applies to fp16; set "
                "loss_scaling={kind='none'} or param_dtype='fp16'"
            )
        if not self.auto_choices or DType.FP32 in self.auto_choices:
            raise ValueError(f"precision.auto_choices={[d.value for d in self.auto_choices]}: name the 16-bit "
                             "dtypes \"auto\" may become, one or both of 'bf16' and 'fp16' (fp32 always can)")
        if is_auto(self.param_dtype) and self.loss_scaling.kind != "none" and DType.FP16 not in self.auto_choices:
            raise ValueError("precision.loss_scaling is set but auto_choices leaves fp16 out: add 'fp16' to "
                             "auto_choices, or set loss_scaling={kind='none'}")
        if not is_auto(self.param_dtype) and self.master_dtype not in (DType.FP32, self.param_dtype):
            raise ValueError(
                f"precision.master_dtype={self.master_dtype!s} with param_dtype={self.param_dtype!s}: "
                "master weights are either fp32 or the compute dtype itself"
            )
        return self

    @property
    def mixed(self) -> bool:
        """Whether compute runs in 16 bits against fp32 master weights."""
        return self.param_dtype in (DType.BF16, DType.FP16) and self.master_dtype is DType.FP32
