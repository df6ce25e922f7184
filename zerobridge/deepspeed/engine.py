"""``DeepSpeedEngine``: DeepSpeed's engine calls on a model any zerobridge backend runs.

    engine(batch)              # forward: the prepared module
    engine.backward(loss)      # loss.backward(): gradients averaged over ranks and micro-steps, as DeepSpeed does
    engine.step()              # at an accumulation boundary: clip, optimizer step, lr step, zero; else count
    engine.save_checkpoint("ckpt", tag="step100", client_state={"epoch": 3})
    path, client_state = engine.load_checkpoint("ckpt")      # the tag in ckpt/latest

The counters (``micro_steps``, ``global_steps``, ``global_samples``) and the
boundary rule are DeepSpeed's: ``is_gradient_accumulation_boundary()`` is
true on the micro-step whose ``step()`` will step the optimizer
(``(micro_steps + 1) % gradient_accumulation_steps == 0``). The backends
already average gradients over accumulation steps and apply the config's
clipping inside the optimizer step, so ``backward`` is ``loss.backward()``
and ``step`` only decides when the optimizer and scheduler move. The learning
rate scheduler steps once per optimizer step, not on a step skipped for an
fp16 overflow (DeepSpeed's rule). Engine calls zerobridge does not carry
are refused by name (``REFUSED``), never a silent no-op.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zerobridge.api import clip_grad_norm_, load_checkpoint, save_checkpoint, stats
from zerobridge.checkpoint.storage import atomic_write_file
from zerobridge.deepspeed.config import RunConfig

__all__ = ["REFUSED", "DeepSpeedEngine"]

LATEST = "latest"
"""The file naming the newest tag in a save directory, as DeepSpeed writes it."""

REFUSED: dict[str, str] = {
    "train_batch": "pipeline parallelism (PipelineEngine) is not carried: call engine(batch), engine.backward(loss) "
                   "and engine.step() per micro-batch",
    "eval_batch": "pipeline parallelism (PipelineEngine) is not carried: call engine(batch) under torch.no_grad()",
    "set_train_batch_size": "the batch size is fixed when the run starts: change the config",
    "offload_states": "moving states off the device on demand is not carried: set zero_optimization.offload_* in "
                      "the config",
    "reload_states": "moving states off the device on demand is not carried: set zero_optimization.offload_* in "
                     "the config",
    "save_16bit_model": "write consolidated weights with zerobridge.save_full(path, engine.module, "
                        "dtype=torch.bfloat16)",
    "module_state_dict": "use zerobridge.full_state_dict(engine.module) for unsharded weights",
    "compile": "pass compile=True to zerobridge.prepare, or set \"compile\": {\"enabled\": true} in the config",
}
"""DeepSpeed engine attributes scripts use that zerobridge does not carry, and what to do instead."""


class DeepSpeedEngine:
    """What ``zerobridge.deepspeed.initialize`` returns as the engine."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: LRScheduler | None, run: RunConfig) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.run = run
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.micro_steps = 0
        """``step()`` calls so far (micro-batches)."""
        self.global_steps = 0
        """Optimizer steps so far (one per accumulation boundary), including fp16 overflow skips."""
        self.global_samples = 0
        """Samples consumed over all ranks: ``train_batch_size`` more at each accumulation boundary."""
        self.skipped_steps = 0
        self._boundary: bool | None = None
        self._grad_norm: float | None = None

    # ------------------------------------------------------------------ forward, backward, step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """``loss.backward()``; every backend averages the gradients over ranks and accumulation steps
        (DeepSpeed's ``scale_wrt_gas``), so the loss itself is not divided here."""
        if not scale_wrt_gas:
            raise NotImplementedError("backward(scale_wrt_gas=False) is not carried: every zerobridge backend "
                                      "averages gradients over the accumulation steps; divide nothing yourself")
        loss.backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """At an accumulation boundary: the optimizer step (which clips to ``gradient_clipping``), the learning
        rate step (unless the step was skipped for an fp16 overflow), ``zero_grad`` and ``train_batch_size``
        more samples. Every call counts a micro-step."""
        if self.is_gradient_accumulation_boundary():
            if self.optimizer is None:
                raise RuntimeError("step() needs an optimizer: pass optimizer= to initialize or an optimizer "
                                   "section in the config")
            self._grad_norm = float(clip_grad_norm_(self.module, math.inf))  # the norm before clipping
            skipped = self._skipped()
            self.optimizer.step()
            if self._skipped() > skipped:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.run.train_batch  # DeepSpeed counts a whole batch at its boundary
        self.micro_steps += 1

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def _skipped(self) -> int:
        return int(stats(self.module).get("skipped_steps", 0))

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step's ``step()`` steps the optimizer."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.run.accumulation == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Treat every following micro-step as a boundary or not, until set again (as DeepSpeed does)."""
        self._boundary = is_boundary

    # ------------------------------------------------------------------ what scripts read
    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, before clipping."""
        return self._grad_norm

    def gradient_accumulation_steps(self) -> int:
        return self.run.accumulation

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.run.micro_batch

    def train_batch_size(self) -> int:
        return self.run.train_batch

    def gradient_clipping(self) -> float:
        return self.run.clip

    def zero_optimization_stage(self) -> int:
        return self.run.stage

    def get_data_parallel_world_size(self) -> int:
        return self.world_size

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse)

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's engine hands unknown names to the wrapped module; so does this one, after refusing
        the engine calls it does not carry."""
        if name in REFUSED:
            raise NotImplementedError(f"DeepSpeedEngine.{name} is not carried by zerobridge.deepspeed: "
                                      f"{REFUSED[name]}")
        if name.startswith("_") or "module" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.__dict__["module"], name)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save model, optimizer, scheduler, counters and ``client_state`` under ``save_dir/tag`` (default
        ``global_stepN``), atomically, and name the tag in ``save_dir/latest``. Collective."""
        if exclude_frozen_parameters:
            raise NotImplementedError("exclude_frozen_parameters is not carried: every parameter is saved")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        counters = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                    "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps}
        save_checkpoint(Path(save_dir) / tag, self.module, self.optimizer, scheduler=self.lr_scheduler,
                        client_state=dict(client_state or {}), metadata={"deepspeed": counters})
        if save_latest and self.global_rank == 0:
            atomic_write_file(Path(save_dir) / LATEST, lambda tmp: tmp.write_text(tag, encoding="utf-8"))
        if dist.is_initialized():
            dist.barrier()
        return True

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (the tag in ``load_dir/latest`` when none is given) at this run's stage and
        world size; return its path and client state, or ``(None, None)`` with a warning when there is no
        ``latest`` (as DeepSpeed does). Collective."""
        if tag is None:
            latest = Path(load_dir) / LATEST
            if not latest.is_file():
                warnings.warn(f"no {latest}: nothing loaded; pass tag= to load a given checkpoint", stacklevel=2)
                return None, None
            tag = latest.read_text(encoding="utf-8").strip()
        path = Path(load_dir) / str(tag)
        optimizer = self.optimizer if load_optimizer_states and not load_module_only else None
        scheduler = self.lr_scheduler if load_lr_scheduler_states and not load_module_only else None
        meta = load_checkpoint(path, self.module, optimizer, scheduler=scheduler, strict=load_module_strict)
        counters = meta.get("deepspeed", {})
        if not load_module_only:  # DeepSpeed restores these three; micro_steps (and the accumulation phase) restart
            for name in ("global_steps", "global_samples", "skipped_steps"):
                setattr(self, name, int(counters.get(name, 0)))
        return str(path), meta.get("client_state", {})
