"""The user's loop on a DeepSpeed engine: ``model(x)``, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()`` and ``zerobridge.clip_grad_norm_``.

[Note: plain backward on DeepSpeed] DeepSpeed 0.19.8 runs a plain
``loss.backward()`` itself at ZeRO stages 1-3 (``engine.forward`` hooks the
outputs: the first gradient runs ``engine._backward_prologue``, each output
gradient is divided by the accumulation steps, and the optimizer calls
``_backward_epilogue`` once every used parameter's gradient arrived). At
stage 0 it refuses (``engine.backward(loss)`` only), so ``DeepSpeedStepper`` does there
what ``engine.backward`` does: it calls the module directly, divides each
output gradient by the accumulation steps, runs the prologue on the first
one and the epilogue at the end of the backward pass.

On every stage ``DeepSpeedStepper`` wraps the prologue to decide the accumulation
boundary itself (``engine.set_gradient_accumulation_boundary``, from the
shared ``AccumulationWindow``): the N-th backward of a window is the boundary, whether the loop calls
``optimizer.step()`` after each micro-batch (a no-op between boundaries, as
on the native engine) or once after N backward passes. ``optimizer.step()``
at a boundary is ``engine.step()``; DeepSpeed clips inside it, so
``clip_grad_norm`` computes the norm the way that step will (and returns
it) and sets the clipping that step applies. Collectives are counted into
the backend's ``CommStats`` only while DeepSpeed runs (forward, backward,
step, clip, full state): the user's own collectives are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerobridge.backends.deepspeed.internals import DeepSpeedInternals
from zerobridge.errors import ConfigError
from zerobridge.runtime import comm_stats
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.window import AccumulationWindow, WindowState, no_gradients

__all__ = ["DeepSpeedModule", "DeepSpeedOptimizer", "DeepSpeedStepper"]


class DeepSpeedStepper:
    """Boundaries, backward, step and clipping for one engine."""

    def __init__(self, engine: Any, model: nn.Module, internals: DeepSpeedInternals, comm: CommStats, *,
                 accumulation_steps: int, clip: float | None) -> None:
        self.engine = engine
        self.model = model
        self.internals = internals
        self.comm = comm
        self.accumulation_steps = accumulation_steps
        self.spec_clip = clip
        """The spec's clipping at step time (``batch.clip_grad_norm``), DeepSpeed's ``gradient_clipping``."""
        self.window = AccumulationWindow(accumulation_steps)
        self.ready = False
        """A closed window's gradients wait for ``step()``."""
        self.inside = False
        """The model is being called by the engine: ``DeepSpeedModule`` runs it plainly."""
        self.user_clip: float | None = None
        self.norm: torch.Tensor | None = None
        """The global norm before clipping at this boundary, once computed."""
        self.plain = not internals.torch_style_backward
        self._prologue, self._epilogue = internals.backward_prologue_epilogue()
        if not self.plain:
            internals.wrap_backward_prologue(self._engine_prologue)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the collectives issued inside into the backend's stats."""
        with comm_stats.counted(self.comm):
            yield

    # ------------------------------------------------------------------ forward and backward

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.inside = True
        try:
            with self.counting():
                output = self.model(*args, **kwargs) if self.plain else self.engine(*args, **kwargs)
        finally:
            self.inside = False
        if self.plain and torch.is_grad_enabled():
            for tensor in pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._output_grad)
        return output

    def _begin(self) -> None:
        self.window.begin()
        self.engine.set_gradient_accumulation_boundary(self.window.boundary)
        comm_stats.count_into(self.comm)

    def _end(self) -> None:
        comm_stats.stop_counting(self.comm)
        if self.window.end():
            self.ready = True
            self.norm = None
            self.user_clip = None

    def _engine_prologue(self) -> None:
        self._begin()
        self._prologue()
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Stage 0: what ``engine.backward`` does around ``loss.backward()``."""
        if not self.window.in_backward:
            self.internals.enter_engine_backward()
            self._begin()
            self._prologue()
            torch.autograd.Variable._execution_engine.queue_callback(self._plain_end)
        return grad / self.accumulation_steps

    def _plain_end(self) -> None:
        try:
            self._epilogue()
        finally:
            self.internals.leave_engine_backward()
            self._end()

    # ------------------------------------------------------------------ step

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global norm now (before clipping); clip to ``max_norm`` (in the coming step)."""
        if norm_type != 2.0:
            raise ConfigError(f"norm_type={norm_type}: DeepSpeed computes and clips the 2-norm only",
                              key="norm_type", fix="use norm_type=2.0, or backend='native'")
        if not self.ready:
            raise no_gradients()
        if self.norm is None:
            with self.counting():
                self.norm = self.internals.grad_norm()
        total = self.norm
        if self.user_clip is not None:  # clipped before in this step: the norm it left
            total = total * torch.clamp(self.user_clip / (total + 1e-6), max=1.0)
        if self.internals.clips_in_step:
            self.user_clip = min(max_norm, self.user_clip if self.user_clip is not None else math.inf)
        else:
            self.internals.clip_now(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            self.norm = None
        return total

    def step(self) -> None:
        """``engine.step()`` at a boundary, with the clipping asked for; a no-op before one."""
        if not self.ready:
            return
        limits = [c for c in (self.user_clip, self.spec_clip) if c is not None and math.isfinite(c)]
        with self.counting():
            if self.internals.clips_in_step:
                self.internals.set_step_clip(min(limits) if limits else None)
            try:
                self.engine.step()
            finally:
                if self.internals.clips_in_step:
                    self.internals.set_step_clip(self.spec_clip)
        self.ready = False
        self.norm = None
        self.user_clip = None

    def zero_grad(self) -> None:
        """Drop gradients, except inside an accumulation window or before a pending step
        (DeepSpeed keeps what it accumulated and reduced until ``step()``)."""
        if self.window.state is WindowState.EMPTY and not self.ready:
            self.engine.zero_grad()


class DeepSpeedModule(nn.Module):
    """Mixed into a prepared model's class: calls go through the DeepSpeed engine,
    names and everything else stay the model's own."""

    _zerobridge_stepper: DeepSpeedStepper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stepper = self.__dict__.get("_zerobridge_stepper")
        if stepper is None or stepper.inside:
            return super().__call__(*args, **kwargs)
        return stepper.forward(args, kwargs)

    @property
    def deepspeed_engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` that runs this model."""
        return self._zerobridge_stepper.engine


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """What ``prepare`` returns as the optimizer: ``step()`` and ``zero_grad()`` drive
    the engine; ``param_groups`` and ``state`` are the user's optimizer's (DeepSpeed
    replaced its parameters by flat partitions; hyperparameters and LR schedulers
    work on them as before). ``state_dict()`` is refused: use zerobridge's checkpoints."""

    def __init__(self, stepper: DeepSpeedStepper, client: torch.optim.Optimizer) -> None:
        # No Optimizer.__init__: the parameters belong to DeepSpeed.
        self._stepper = stepper
        self.client = client
        self.defaults = client.defaults

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # read-only: the client's groups
        return self.client.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # read-only: the client's state
        return self.client.state

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("DeepSpeed steps without a closure", key="closure",
                              fix="compute the loss and call loss.backward() before optimizer.step()")
        self._stepper.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stepper.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        raise ConfigError("the optimizer's state is partitioned by DeepSpeed", key="optimizer.state_dict",
                          fix="save with zerobridge.save_checkpoint(path, model, optimizer)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ConfigError("the optimizer's state is partitioned by DeepSpeed", key="optimizer.load_state_dict",
                          fix="load with zerobridge.load_checkpoint(path, model, optimizer)")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("DeepSpeed fixes the param groups at prepare", key="optimizer.add_param_group",
                          fix="build every group before zerobridge.prepare")

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({self.client!r})"
