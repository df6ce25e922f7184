"""Initialize a meta-device model with the values an eager build would have had.

    >>> import torch
    >>> from zerobridge.runtime.deferred_init import Replay
    >>> _ = torch.manual_seed(0); eager = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> _ = torch.manual_seed(0)
    >>> with torch.device("meta"):
    ...     lazy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> replay = Replay(lazy)
    >>> replay.record()                                  # advances the RNG as the eager build did
    >>> values = dict(replay.materialize(replay.params_of(lazy[1])))
    >>> torch.equal(values[id(lazy[1].weight)], eager[1].weight)
    True

[Note: construction replay]
An eager build draws every initial value from the global CPU generator in the
order the constructors run. On the meta device nothing is drawn, so the same
stream is replayed here as a list of *init ops*, in construction order:

- a module's children are built (and initialized) before its own
  ``reset_parameters()`` (or torch's private ``_reset_parameters()``) runs:
  post-order, the order of every torch module that resets at the end of
  ``__init__``. Such an op may touch its whole subtree (``MultiheadAttention``
  zeroes its ``out_proj.bias``).
- a Hugging Face model (a module with ``_init_weights`` and ``config``) is an
  *init scope*: once its children are built, ``post_init`` runs its
  ``_init_weights`` on every module of its subtree not yet initialized by an
  inner scope, children first. An op of that kind touches only the module's
  own tensors.
- ``init_fn`` given: it replaces all of the above and is called on every
  module, children first.

``record`` runs every op once, on scratch tensors one op at a time, and keeps
the generator state before each; the generator ends where the eager build's
would. ``materialize`` then produces any set of parameters, at any time and
in any order, by re-running just the ops that touch them from their recorded
states: so a rank needs one module's tensors at a time, never the model.

A parameter tied to several modules takes the values of its first owner (in
registration order); ops on a later owner write scratch tensors, so the
generator still advances as it did when that owner built its own weight
before the tie. A parameter or floating buffer that no op writes completely
is an error naming it (scratch tensors start as NaN to tell).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.errors import ConfigError

__all__ = ["InitOp", "Replay", "ShapeReplay", "agree_generator", "is_meta_model", "materialize_device",
           "replay_on_every_rank"]

Slot = tuple[nn.Module, str, bool]
"""(module, attribute, is_buffer)."""


@dataclass(frozen=True, eq=False)
class InitOp:
    """One call the eager build made that wrote initial values."""

    module: nn.Module
    call: Callable[[], object]
    deep: bool
    """It may write the whole subtree's tensors (torch ``reset_parameters``)."""
    label: str


def is_meta_model(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (every parameter and buffer
    there); a model partly on meta is an error naming what is."""
    tensors = [(name, t) for name, t in (*model.named_parameters(), *model.named_buffers())]
    meta = [name for name, t in tensors if t.is_meta]
    if not meta:
        return False
    real = [name for name, t in tensors if not t.is_meta]
    if real:
        raise ConfigError(f"{type(model).__name__} is partly on the meta device: {', '.join(meta[:3])} on meta, "
                          f"{', '.join(real[:3])} not", key="model",
                          fix="build the whole model under `with torch.device('meta'):` (or none of it)")
    return True


def _hf_scope(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config") and hasattr(
        module, "post_init")


def _reset_method(module: nn.Module) -> Callable[[], object] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        method: object = getattr(module, name, None)
        if callable(method) and not _hf_scope(module):
            return method
    return None


def _hf_call(scope: nn.Module, module: nn.Module) -> Callable[[], object]:
    # A method of Hugging Face's PreTrainedModel (untyped), which nn.Module's __getattr__ types as Tensor | Module.
    init_weights = cast("Callable[[nn.Module], object]", scope._init_weights)
    call = functools.partial(init_weights, module)
    try:
        from transformers import initialization
        guard = getattr(initialization, "guard_torch_init_functions", None)
    except ImportError:  # pragma: no cover - only HF models reach here
        guard = None
    if guard is None:
        return call

    def guarded() -> object:
        with guard():
            return call()
    return guarded


def plan_ops(model: nn.Module, init_fn: Callable[[nn.Module], object] | None = None) -> list[InitOp]:
    """The init ops of an eager build of ``model``, in the order it ran them."""
    if init_fn is not None:
        return [InitOp(m, functools.partial(init_fn, m), False, f"init_fn({name or type(m).__name__})")
                for name, m in _post_order(model)]
    ops: list[InitOp] = []
    done: set[int] = set()

    def build(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            build(child, f"{name}.{child_name}" if name else child_name)
        if _hf_scope(module):
            for sub_name, sub in _post_order(module, name):
                if id(sub) not in done:
                    done.add(id(sub))
                    # Inner models already initialized their whole subtrees, so ``module``
                    # is the innermost model of every module left here.
                    ops.append(InitOp(sub, _hf_call(module, sub), False,
                                      f"{type(module).__name__}._init_weights({sub_name or 'root'})"))
            return
        reset = _reset_method(module)
        if reset is not None:
            ops.append(InitOp(module, reset, True, f"{name or 'root'}.{reset.__name__}()"))

    build(model, "")
    return ops


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


class Replay:
    """The init ops of a meta-device model, recorded once, replayed on demand."""

    def __init__(self, model: nn.Module, init_fn: Callable[[nn.Module], object] | None = None) -> None:
        self.model = model
        self.init_fn = init_fn
        self.ops = plan_ops(model, init_fn)
        # Each slot holding a meta tensor; the first slot of a tensor owns its values.
        self.first: dict[int, Slot] = {}
        self.names: dict[int, str] = {}
        self.meta: dict[int, torch.Tensor] = {}
        self.built: dict[int, tuple[torch.Size, torch.dtype]] = {}
        """Each tensor's shape and dtype as built: a backend may change the tensor itself (FSDP2
        casts the meta masters before sharding; DeepSpeed partitions the parameter object in
        place), and the eager values are drawn in these."""
        for module_name, module in model.named_modules(remove_duplicate=False):
            for store, is_buffer in ((module._parameters, False), (module._buffers, True)):
                for attr, t in store.items():
                    if t is not None and t.is_meta and id(t) not in self.first:
                        self.first[id(t)] = (module, attr, is_buffer)
                        self.names[id(t)] = f"{module_name}.{attr}" if module_name else attr
                        self.meta[id(t)] = t
                        self.built[id(t)] = (t.shape, t.dtype)
        # Computed now, while the slots still hold the meta tensors (the engine
        # later puts its own parameters there).
        self.slots = [self._slots(op) for op in self.ops]
        self.touches: dict[int, list[int]] = {key: [] for key in self.first}
        for k, slots in enumerate(self.slots):
            for _, _, _, key, owner in slots:
                if owner:
                    self.touches[key].append(k)
        self.owned: dict[int, list[int]] = {}
        """Keys by ``id()`` of their first owner module."""
        for key, (module, _, _) in self.first.items():
            self.owned.setdefault(id(module), []).append(key)
        self.states: list[torch.Tensor] = []
        self.end_state: torch.Tensor | None = None

    def _slots(self, op: InitOp) -> list[tuple[nn.Module, str, bool, int, bool]]:
        """(module, attribute, is_buffer, tensor key, first owner) of each meta slot the op may write."""
        modules = op.module.modules() if op.deep else [op.module]
        found = []
        for m in modules:
            for store, is_buffer in ((m._parameters, False), (m._buffers, True)):
                for attr, t in store.items():
                    if t is not None and id(t) in self.first:
                        found.append((m, attr, is_buffer, id(t), self.first[id(t)][:2] == (m, attr)))
        return found

    def params_of(self, module: nn.Module) -> list[int]:
        """Keys of the tensors ``module`` itself owns (its first-owner slots)."""
        return list(self.owned.get(id(module), ()))

    # ------------------------------------------------------------------ running ops

    @contextmanager
    def _swapped(self, k: int, real: dict[int, torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
        """Put a tensor in every slot op ``k`` may write: ``real`` ones where given,
        NaN scratch elsewhere; the slots get their old contents back after."""
        undo: list[Callable[[], None]] = []
        written: dict[int, torch.Tensor] = {}
        try:
            for module, attr, is_buffer, key, owner in self.slots[k]:
                tensor = real[key] if owner and key in real else _scratch(*self.built[key])
                if owner:
                    written[key] = tensor
                meta = self.meta[key]
                if is_buffer:
                    undo.append(_put(module._buffers, attr, tensor))
                else:
                    undo.append(_put(module._parameters, attr, nn.Parameter(tensor, requires_grad=meta.requires_grad)))
            yield written
        finally:
            for put_back in reversed(undo):
                put_back()

    def _run(self, k: int, real: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        op = self.ops[k]
        with self._swapped(k, real) as written, torch.no_grad():
            try:
                op.call()
            except Exception as exc:
                raise ConfigError(f"initializing {op.label} on scratch tensors failed: {type(exc).__name__}: {exc}",
                                  key="model", fix="make the module's init work on CPU tensors, or pass "
                                  "prepare(..., init_fn=fn) to initialize it yourself") from None
            return {key: _unwrap(t) for key, t in written.items()}

    def record(self) -> None:
        """Run every op once on scratch tensors from the current generator state,
        keeping the state before each; check that every tensor gets written.
        Leaves the generator where the eager build would have."""
        covered: set[int] = set()
        self.states = []
        for k in range(len(self.ops)):
            self.states.append(torch.get_rng_state())
            for key, tensor in self._run(k, {}).items():
                if not tensor.is_floating_point() or not torch.isnan(tensor).any():
                    covered.add(key)
        self.end_state = torch.get_rng_state()
        missing = [self.names[key] for key in self.first
                   if key not in covered and self.meta[key].is_floating_point()]
        if missing:
            kind = "init_fn" if self.init_fn is not None else "reset_parameters() or _init_weights()"
            raise ConfigError(
                f"no {kind} initializes {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} of the "
                f"meta-device {type(self.model).__name__}", key="model",
                fix="give the module a reset_parameters() that fills it, or pass prepare(..., init_fn=fn) "
                    "with fn(module) initializing each module's own tensors")

    def materialize(self, keys: Iterable[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """The eager values of the tensors ``keys`` (CPU, their own dtype): the ops
        touching them re-run from their recorded generator states. The generator
        is left where ``record`` left it."""
        assert self.end_state is not None, "record() first"
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return
        real = {key: _scratch(*self.built[key]) for key in wanted}
        ops = sorted({k for key in wanted for k in self.touches[key]})
        try:
            for k in ops:
                torch.set_rng_state(self.states[k])
                self._run(k, real)
        finally:
            torch.set_rng_state(self.end_state)
        for key in wanted:
            yield key, real[key]

    def put_buffer(self, key: int, value: torch.Tensor, device: torch.device) -> None:
        """Make ``value`` the buffer ``key`` on its owner, on ``device`` in the dtype the
        slot holds now (a backend may have cast the meta buffer)."""
        owner, attr, is_buffer = self.first[key]
        assert is_buffer
        current = owner._buffers[attr]
        assert current is not None
        owner._buffers[attr] = value.to(device, current.dtype)

    def by_module(self, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """``materialize`` one module at a time, in registration order: the eager values
        of each tensor ``keep(key)`` accepts (default: all), with at most one module's
        tensors alive while the caller holds only the current one."""
        for module in self.model.modules():
            keys = [key for key in self.params_of(module) if keep is None or keep(key)]
            yield from self.materialize(keys)


class ShapeReplay(Replay):
    """A replay that writes no values: every tensor materializes empty, in its built shape and
    dtype, and no init op runs. For runs that need only shapes (``zerobridge plan`` runs the
    engine on fake tensors); it draws nothing from the generator."""

    def record(self) -> None:
        """Nothing to record: no op runs."""
        self.states = []
        self.end_state = torch.empty(0, dtype=torch.uint8)

    def materialize(self, keys: Iterable[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """Empty tensors of the built shapes and dtypes of ``keys``."""
        for key in dict.fromkeys(keys):
            shape, dtype = self.built[key]
            yield key, torch.empty(shape, dtype=dtype, device="cpu")


_T = TypeVar("_T", bound=torch.Tensor)


def _put(store: dict[str, _T | None], attr: str, value: _T) -> Callable[[], None]:
    """Put ``value`` in ``store[attr]`` (a module's ``_parameters`` or ``_buffers``); returns what puts
    the old contents back."""
    old = store[attr]
    store[attr] = value
    return functools.partial(store.__setitem__, attr, old)


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device="cpu")
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    return tensor


def _unwrap(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.data if isinstance(tensor, nn.Parameter) else tensor


# ----------------------------------------------------------------- on every rank


def materialize_device(device: torch.device | str | None) -> torch.device:
    """Where a meta-device model materializes: ``device``, else this rank's GPU, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def agree_generator(device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Start every rank's CPU generator from rank 0's state, so that every rank
    replays the same initial values. Returns whether this rank's state already was
    rank 0's (then its generator ends as after an eager build; otherwise the caller
    puts its own state back after the replay: ``replay_on_every_rank``). Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return True
    own = torch.get_rng_state()
    state = own.to(device, copy=True)
    dist.broadcast(state, src=0, group=group)
    state = state.cpu()
    torch.set_rng_state(state)
    return bool(torch.equal(state, own))


def replay_on_every_rank(replay: Replay, device: torch.device) -> None:
    """Record the construction replay from rank 0's generator state on every rank
    (so every rank produces the same values); a rank whose own state differed gets
    it back afterwards. Collective. A ``ShapeReplay`` has nothing to agree on."""
    if isinstance(replay, ShapeReplay):
        replay.record()
        return
    own = torch.get_rng_state()
    same = agree_generator(device)
    replay.record()
    if not same:
        replay.end_state = own
        torch.set_rng_state(own)
