"""Reading and writing a DeepSpeed engine's state: the one place that touches its private attributes.

DeepSpeed 0.19.8 wraps the user's optimizer in one of a few classes, chosen
by stage and precision; each keeps gradients, fp32 master weights and the
optimizer's state differently:

================================  ==========================================  ==========================
``engine.optimizer``              when                                        masters / state
================================  ==========================================  ==========================
the user's optimizer itself       stage 0, fp32                               the parameters themselves
``FP16_UnfusedOptimizer``         stage 0, bf16                               one fp32 copy per parameter
``DeepSpeedZeroOptimizer``        stages 1-2                                  ``deepspeed.utils.safe_*``
``BF16_Optimizer``                stage 1, bf16 with fp32 accumulation        ``deepspeed.utils.safe_*``
``DeepSpeedZeroOptimizer_Stage3`` stage 3                                     ``deepspeed.utils.safe_*``
================================  ==========================================  ==========================

``DeepSpeedInternals`` hides the difference: the global gradient norm
computed the way the coming ``step()`` will compute it, the clipping that
step applies, full fp32 masters and optimizer state per parameter
(collective under ZeRO), and the bytes held by role and tier. Every rank
must call the collective methods in the same parameter order.

It is also where the backend reaches into the engine's backward machinery
(``_backward_prologue``, ``_backward_epilogue``, the running-backward
count), the skipped-step counter and the comm backend's cached collectives
(``recount_collectives``): nowhere else in zerobridge names a private
DeepSpeed attribute, so a DeepSpeed upgrade is checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zerobridge.runtime.step_rules import norm_part
from zerobridge.runtime.tensors import StorageCounter

__all__ = ["DeepSpeedInternals", "held_bytes", "recount_collectives", "shape_of"]

_MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
            "fp32_groups")
"""Attributes holding fp32 master weights, whichever wrapper it is."""
_GRADS = ("averaged_gradients", "grad_partitions_flat_buffer", "fp32_groups_gradients_flat")
"""Attributes holding reduced or accumulated gradients (besides ``.grad``)."""


def shape_of(param: nn.Parameter) -> torch.Size:
    """A parameter's full shape (stage 3 keeps only a partition in ``param.data``)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class DeepSpeedInternals:
    """What the backend reads from and writes into one DeepSpeed engine."""

    def __init__(self, engine: Any, model: nn.Module, client: torch.optim.Optimizer) -> None:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self.engine = engine
        self.model = model
        self.client = client
        wrapper = engine.optimizer
        self.wrapper = wrapper
        self.stage3 = isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3)
        self.zero12 = isinstance(wrapper, DeepSpeedZeroOptimizer)
        self.bf16 = isinstance(wrapper, BF16_Optimizer)
        self.partitioned = self.stage3 or self.zero12 or self.bf16
        """Masters and state are partitioned and reached through ``deepspeed.utils.safe_*``."""
        self.copies: dict[int, torch.Tensor] = {}
        """Stage 0: the tensor the optimizer steps for each parameter (by id)."""
        self.unfused = isinstance(wrapper, FP16_UnfusedOptimizer)
        if self.unfused:
            for low, high in zip(wrapper.fp16_groups, wrapper.fp32_groups):
                self.copies.update({id(p): q for p, q in zip(low, high)})
        elif not self.partitioned:
            if wrapper is not client:
                raise TypeError(f"unexpected DeepSpeed optimizer wrapper {type(wrapper).__name__}")
            self.copies = {id(p): p for p in model.parameters() if p.requires_grad}

    # ------------------------------------------------------------------ backward and counters

    @property
    def torch_style_backward(self) -> bool:
        """Whether the engine runs a plain ``loss.backward()`` itself (ZeRO stages 1-3 in 0.19.8)."""
        return bool(self.engine._support_torch_style_backward)

    def backward_prologue_epilogue(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """The engine's own ``_backward_prologue`` and ``_backward_epilogue``."""
        return self.engine._backward_prologue, self.engine._backward_epilogue

    def wrap_backward_prologue(self, prologue: Callable[[], None]) -> None:
        """Make ``prologue`` what the engine's output hooks run first in every backward (they look
        ``_backward_prologue`` up per call)."""
        self.engine._backward_prologue = prologue

    def enter_engine_backward(self) -> None:
        """Mark a backward as the engine's own (what ``engine.backward`` does around it)."""
        engine = self.engine
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True

    def leave_engine_backward(self) -> None:
        """The engine's own backward is over."""
        engine = self.engine
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count -= 1
            engine._running_engine_backward = engine._running_engine_backward_count > 0

    @property
    def skipped_steps(self) -> int:
        """Steps the engine skipped (fp16 overflow)."""
        return int(self.engine.skipped_steps)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.engine.skipped_steps = int(value)

    def restore_initial(self, originals: dict[int, torch.Tensor]) -> None:
        """Undo what DeepSpeed's initialisation did to the masters: make them the user's fp32
        values again (DeepSpeed copies them from the 16-bit cast), and, at stage 0 in bf16, drop
        the state of the zero-gradient step ``FP16_UnfusedOptimizer`` takes at init (it counts as
        Adam's first step and applies weight decay once). Collective at stage 3."""
        if self.unfused:
            self.client.state.clear()
        if originals:
            self.set_masters(originals)

    # ------------------------------------------------------------------ step time

    def trainable(self) -> list[nn.Parameter]:
        """Trainable parameters, each once, in module order."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def grad_norm(self) -> torch.Tensor:
        """The global gradient 2-norm the coming ``engine.step()`` computes. Collective under ZeRO."""
        wrapper = self.wrapper
        if self.zero12:
            norm = wrapper.scaled_global_norm() / wrapper.loss_scale
        elif self.stage3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(wrapper._get_norm_groups()) / wrapper.loss_scale
        elif self.bf16:
            from deepspeed.runtime.utils import get_global_norm_of_tensors

            grads, _ = wrapper.get_grads_for_norm()
            norm = get_global_norm_of_tensors(input_tensors=grads, mpu=wrapper.mpu, norm_type=2)
        else:  # stage 0: every rank holds the same reduced gradients; float64 as DeepSpeed's ZeRO norms
            grads = [p.grad for p in self.trainable() if p.grad is not None]
            norm = norm_part(grads, 2.0, torch.device("cpu"))[0].sqrt()
        return torch.as_tensor(norm, dtype=torch.float32).detach().reshape(()).cpu()

    @property
    def clips_in_step(self) -> bool:
        """Whether ``step()`` clips by ``wrapper.clip_grad`` (else the backend clips ``.grad`` itself)."""
        return hasattr(self.wrapper, "clip_grad") and self.wrapper is not self.client

    def set_step_clip(self, max_norm: float | None) -> None:
        """The clipping the coming ``step()`` applies (``None``: none)."""
        self.wrapper.clip_grad = 0.0 if max_norm is None else float(max_norm)

    def clip_now(self, coefficient: torch.Tensor) -> None:
        """Stage 0 fp32: scale every ``.grad`` in place."""
        grads = [p.grad for p in self.trainable() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))

    # ------------------------------------------------------------------ masters and optimizer state

    def full_master(self, param: nn.Parameter) -> torch.Tensor:
        """The full fp32 master of ``param`` (its model value when frozen). Collective under ZeRO."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        value = safe_get_full_fp32_param(param) if self.partitioned and param.requires_grad else None
        if value is None and id(param) in self.copies:
            value = self.copies[id(param)]
        if value is None and self.stage3:
            with deepspeed.zero.GatheredParameters([param]):
                value = param.detach().clone()
        if value is None:
            value = param.detach()
        return value.detach().to(torch.float32, copy=True).reshape(shape_of(param))

    def set_masters(self, values: dict[int, torch.Tensor]) -> None:
        """Put full values (by parameter id) into the masters and the compute parameters. Collective
        at stage 3 (every rank passes the same values)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        params = [p for p in self.model.parameters() if id(p) in values]
        with torch.no_grad():
            for param in params:
                value = values[id(param)]
                if self.stage3 and param.requires_grad:
                    self._set_stage3(param, value)
                elif self.partitioned and param.requires_grad:
                    safe_set_full_fp32_param(param, value.to(torch.float32))
                if id(param) in self.copies:
                    self.copies[id(param)].copy_(value.reshape(param.shape))
            if self.stage3:  # the compute partitions: gather, write on rank 0, re-partition from it
                with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                    for param in params:
                        param.data.copy_(values[id(param)].reshape(shape_of(param)).to(param.dtype))
            else:
                for param in params:
                    if id(param) not in self.copies or self.copies[id(param)] is not param:
                        param.data.copy_(values[id(param)].reshape(param.shape).to(param.dtype))

    def _set_stage3(self, param: nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """This rank's piece of a full value into its fp32 partition (master, or state ``key``).
        NOTE: DeepSpeed 0.19.8's ``set_full_hp_param`` cannot write the last rank's piece of a
        parameter whose size the world size does not divide (it asserts the unpadded size, then
        reads past it); here the piece is cut short and the padding zeroed."""
        wrapper = self.wrapper
        part, group = wrapper._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
        start = part.numel() * wrapper._get_param_partition_rank(param)
        piece = value.detach().reshape(-1)[start:start + part.numel()]
        with torch.no_grad():
            part[:piece.numel()].copy_(piece)
            part[piece.numel():].zero_()
        if wrapper._swappable_optimizer_subgroup(group):
            wrapper._optimizer_states_and_gradient_swap_out(group)

    def _flats(self) -> list[list[torch.Tensor]]:
        """Per client param group, the tensors its optimizer state is keyed by (stage 3 keeps
        them out of the groups between steps, one flat per sub-group)."""
        if not self.stage3:
            return [list(group["params"]) for group in self.client.param_groups]
        flats: list[list[torch.Tensor]] = [[] for _ in self.client.param_groups]
        for sub, flat in enumerate(self.wrapper.fp32_partitioned_groups_flat):
            flats[self.wrapper.sub_group_to_group_id[sub]].append(flat)
        return flats

    def _holders(self, param: nn.Parameter, group_index: int) -> list[torch.Tensor]:
        """The tensors whose optimizer state holds ``param``'s scalars (``step``)."""
        if id(param) in self.copies:
            return [self.copies[id(param)]]
        if self.stage3:
            sub = self.wrapper.grad_position[self.wrapper.get_param_id(param)][0]
            return [self.wrapper.fp32_partitioned_groups_flat[sub]]
        return list(self.client.param_groups[group_index]["params"])

    def ensure_state(self) -> None:
        """Create the optimizer's state where it has none yet (before the first step), with one
        step at learning rate 0 on zero gradients, so that values can be written into it."""
        flats = self._flats()
        missing = [p for group in flats for p in group if p.requires_grad and not self.client.state.get(p)]
        if not missing:
            return
        saved = [(group.get("lr"), group.get("weight_decay"), group["params"]) for group in self.client.param_groups]
        hidden = {id(p): p.grad for group in flats for p in group}
        for group, held in zip(self.client.param_groups, flats):
            group["lr"], group["params"] = 0.0, held
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            for flat in held:  # only the tensors without state take part in this step
                flat.grad = None
        for flat in missing:
            flat.grad = torch.zeros_like(flat)
        try:
            self.client.step()
        finally:
            for group, (lr, decay, params) in zip(self.client.param_groups, saved):
                group["lr"], group["params"] = lr, params
                if decay is not None:
                    group["weight_decay"] = decay
            for held in flats:
                for flat in held:
                    flat.grad = hidden[id(flat)]
        self.relink()

    def relink(self) -> None:
        """Point DeepSpeed's per-parameter fragments at the optimizer's state again.
        NOTE: stages 1-2 link them right after stepping param group 0, before torch
        created the state of later groups (the bug ``testing/deepspeed_run.py`` works around)."""
        if self.client.state and getattr(self.wrapper, "_hp_optimizer_states_linked", None) is not None:
            self.wrapper._hp_optimizer_states_linked = False
            self.wrapper._lazy_init_hp_params_optimizer_state()

    def state_keys(self) -> dict[str, bool]:
        """The optimizer's state keys, each True when shaped like its parameter (else a scalar)."""
        for flat in (f for group in self._flats() for f in group):
            state = self.client.state.get(flat)
            if state:
                return {k: isinstance(v, torch.Tensor) and v.dim() > 0 for k, v in state.items()
                        if isinstance(v, torch.Tensor)}
        return {}

    def full_state(self, param: nn.Parameter, group_index: int) -> dict[str, torch.Tensor]:
        """The full optimizer state of ``param``. Collective under ZeRO."""
        from deepspeed.utils import safe_get_full_optimizer_state

        out: dict[str, torch.Tensor] = {}
        owner = self.copies.get(id(param))
        if owner is not None and not self.client.state.get(owner):
            return out  # stage 0: never stepped (no gradient yet), as torch leaves it
        for key, shaped in self.state_keys().items():
            if not shaped:
                out[key] = self._scalar(param, group_index, key)
            elif owner is not None:
                out[key] = self.client.state[owner][key].detach().float().clone().reshape(param.shape)
            else:
                out[key] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
        return out

    def _scalar(self, param: nn.Parameter, group_index: int, key: str) -> torch.Tensor:
        value: torch.Tensor = self.client.state[self._holders(param, group_index)[0]][key]
        return value.detach().clone()

    def set_state(self, param: nn.Parameter, group_index: int, state: dict[str, torch.Tensor]) -> None:
        """Write full optimizer state into ``param``'s fragments (scalars into its group)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        owner = self.copies.get(id(param))
        shaped = self.state_keys()
        for key, value in state.items():
            if key not in shaped:
                continue
            if not shaped[key]:
                for flat in self._holders(param, group_index):
                    self.client.state[flat][key] = value.detach().clone().to(self.client.state[flat][key].dtype)
            elif owner is not None:
                self.client.state[owner][key].copy_(value.reshape(owner.shape))
            elif self.stage3:
                self._set_stage3(param, value, key)
            else:
                safe_set_full_optimizer_state(param, value.to(torch.float32), key)


def held_bytes(internals: DeepSpeedInternals, *, offload_optimizer: bool, offload_params: bool) -> dict[str, Any]:
    """Bytes this rank holds now, by role (``param_bytes``, ``grad_bytes``,
    ``optimizer_bytes``: masters plus optimizer state) and by tier; each storage
    counted once. DeepSpeed's communication scratch buffers are not counted."""
    count = StorageCounter().add

    wrapper, model = internals.wrapper, internals.model
    shards = (getattr(p, "ds_tensor", None) for p in model.parameters())
    params = (count(t for t in shards if t is not None) if internals.stage3
              else count(p.data for p in model.parameters()))
    masters = [t for name in _MASTERS for t in _tensors(getattr(wrapper, name, None))]
    grads = count(p.grad for p in model.parameters() if p.grad is not None)
    grads += count(t.grad for t in masters if t.grad is not None)
    grads += count(t for name in _GRADS for t in _tensors(getattr(wrapper, name, None)))
    optimizer = count(iter(masters)) + count(t for state in internals.client.state.values() for t in _tensors(state))
    tiers = {"device": grads + (0 if offload_params else params) + (0 if offload_optimizer else optimizer),
             "host": (params if offload_params else 0) + (optimizer if offload_optimizer else 0), "nvme": 0}
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optimizer, "tier_bytes": tiers}


def recount_collectives(deepspeed: Any) -> None:
    """DeepSpeed's torch comm backend keeps the all-gather and reduce-scatter functions it found
    when it was built; one built before ``comm_stats.install`` would hold uncounted ones."""
    backend = getattr(deepspeed.comm.comm, "cdb", None)
    if backend is not None and hasattr(backend, "get_all_gather_function"):
        backend.all_gather_function = backend.get_all_gather_function()
        backend.reduce_scatter_function = backend.get_reduce_scatter_function()
