"""fp16 loss scaling: a scale that multiplies gradients in backward, and its update rule.

    >>> from zerobridge.runtime.loss_scale import LossScaler
    >>> from zerobridge.spec import DynamicLossScale
    >>> s = LossScaler(DynamicLossScale(initial_scale=8.0, growth_interval=2, hysteresis=2))
    >>> [s.update(found_inf=x) or s.scale for x in (True, True, False, False)]
    [8.0, 4.0, 4.0, 8.0]

Dynamic scaling follows DeepSpeed's rule: an overflow uses up one unit of
hysteresis, and once none is left the scale is multiplied by the backoff
factor (never below ``min_scale``); after ``growth_interval`` steps without
overflow the scale grows by ``growth_factor`` and the hysteresis refills.
"""

from __future__ import annotations

import torch

from zerobridge.spec import DynamicLossScale, LossScaling, StaticLossScale

__all__ = ["LossScaler", "ScaleGrad"]


class LossScaler:
    """The current loss scale and its update after each optimizer step."""

    def __init__(self, config: LossScaling) -> None:
        self.config = config
        self.scale = 1.0
        if isinstance(config, StaticLossScale):
            self.scale = config.scale
        elif isinstance(config, DynamicLossScale):
            self.scale = config.initial_scale
            self._hysteresis = config.hysteresis
        self._clean_steps = 0

    @property
    def enabled(self) -> bool:
        return self.config.kind != "none"

    def update(self, *, found_inf: bool) -> None:
        """Account one step; ``found_inf``: some gradient was inf or nan."""
        config = self.config
        if not isinstance(config, DynamicLossScale):
            return
        if found_inf:
            self._clean_steps = 0
            if self._hysteresis > 1:
                self._hysteresis -= 1
            else:
                self.scale = max(self.scale * config.backoff_factor, config.min_scale)
            return
        self._clean_steps += 1
        if config.consecutive_hysteresis:
            self._hysteresis = config.hysteresis
        if self._clean_steps % config.growth_interval == 0:
            self.scale *= config.growth_factor
            self._hysteresis = config.hysteresis


    def state_tensor(self) -> torch.Tensor:
        """``[scale, hysteresis, clean steps]`` as float64 (hysteresis -1 when the scale is not
        dynamic): what a checkpoint keeps to resume the scale where it was."""
        hysteresis = float(getattr(self, "_hysteresis", -1))
        return torch.tensor([self.scale, hysteresis, float(self._clean_steps)], dtype=torch.float64)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        """Resume from ``state_tensor``'s value when both runs scale dynamically (a static or
        absent scale comes from the spec, not from the checkpoint)."""
        scale, hysteresis, clean = state.tolist()
        if isinstance(self.config, DynamicLossScale) and hysteresis >= 0:
            self.scale, self._hysteresis, self._clean_steps = scale, int(hysteresis), int(clean)


class ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by the scale in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]
