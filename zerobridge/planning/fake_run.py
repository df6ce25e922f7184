"""One candidate, run for real on fake tensors: the engine trains two steps as one rank of the world.

    >>> import torch.distributed as dist
    >>> from zerobridge.planning.fake_run import Run, run_once
    >>> from zerobridge.planning.models import resolve_model
    >>> from zerobridge.spec.presets import spec_for_stage
    >>> source = resolve_model("tiny-gpt")
    >>> run = Run(world_size=4, nodes=1, micro_batch=2, seq_len=16, accumulation=1)
    >>> m = run_once(source, spec_for_stage(3, source.build()), run)
    >>> m.model_states["params"] * 4 >= 118400 * 4, m.comm_bytes["all_gather"] > 0
    (True, True)
    >>> dist.is_initialized()                 # the fake group lived for the run only
    False

The rank is rank 0 of a fake process group of ``world_size`` ranks
(``init_process_group("fake")``: every collective returns at once, moving
nothing) and every tensor is a ``FakeTensor`` (shapes, dtypes and storage
sizes, no memory): so the native engine runs its real code (flat buffers,
shards, gathers and frees, reduce buckets, the optimizer on its shard,
activation checkpointing) at any model size, and a ``StorageTracker`` counts
the bytes it holds after every operation. The engine's own accounting gives
what lives on each tier (``engine.memory``) and what each collective moves
(``engine.stats``: bus bytes, counted as a real run counts them).

The first step creates the optimizer's state; the second is the steady state
a long run repeats, and its collectives are the ones reported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from zerobridge.backends.native.prepare import prepare
from zerobridge.engine import Engine
from zerobridge.errors import ConfigError
from zerobridge.planning.models import ModelSource
from zerobridge.planning.tracker import StorageTracker
from zerobridge.runtime.deferred_init import Replay, ShapeReplay
from zerobridge.spec import StrategySpec

__all__ = ["CountingFakeMode", "Measured", "Run", "fake_tracking", "fake_world", "optimizer_for", "run_once",
           "run_real", "train_two_steps"]


@dataclass(frozen=True)
class Run:
    """What the plan is for: ranks, nodes, and one rank's batch."""

    world_size: int
    nodes: int
    micro_batch: int
    seq_len: int
    accumulation: int = 1
    optimizer: str = "adamw"
    """``adamw`` or ``adamw-fused`` (two fp32 moments per parameter) or ``sgd`` (one: momentum); built
    by ``optimizer_for``."""

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one node."""
        return self.world_size // self.nodes


@dataclass(frozen=True)
class Measured:
    """What one rank held and moved in a two-step fake run."""

    peaks: dict[str, int]
    """Highest live tensor bytes in each phase (``setup``, ``forward``, ``backward``, ``step``)."""
    tiers: dict[str, int]
    """Model-state bytes at rest by where they live (``device``, ``host``, ``nvme``), engine accounting."""
    model_states: dict[str, int]
    """Resident model-state bytes by role (``params``, ``grads``, ``optimizer``: master and moments)."""
    comm_bytes: dict[str, int]
    """Bus bytes one rank moves per optimizer step, by collective."""
    comm_calls: dict[str, int]
    """Collectives issued per optimizer step, by kind."""


@contextmanager
def fake_world(world_size: int, ranks_per_node: int) -> Iterator[None]:
    """Rank 0 of a fake process group of ``world_size`` ranks, ``ranks_per_node`` to a node, for the
    block; the group is destroyed after it, so nothing later in the process sees it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: torch's test tree, planning only

    if dist.is_initialized():
        raise ConfigError("this process already has a process group, and a plan runs rank 0 of a fake one",
                          key="world_size", fix="plan before init_process_group, or with workers=2 or more "
                                                "(each candidate then runs in a fresh process)")
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


class CountingFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that counts what every operation returns in a ``StorageTracker``.

    A ``StorageTracker`` stacked above the fake mode as a mode of its own (how real runs are counted)
    makes every operation cross from C++ into Python twice; counted here, once. The figures are the
    same (``tests/test_plan.py``): only the outermost call is counted, as the fake mode's own
    decompositions run below a mode stacked above it; an operation on a tensor subclass with its own
    dispatch (FSDP2's DTensor) is run as a mode above would run it, its outputs counted and the
    operations on the fake tensors inside it not. Autograd asks every gradient's device (``prim.device``:
    about 700 of a fake step's 1,100 dispatched operations per block); it is answered here as
    ``FakeTensor`` would, without the fake mode's dispatch.

    >>> import torch
    >>> from zerobridge.planning.fake_run import fake_tracking
    >>> with fake_tracking() as tracker:
    ...     a = torch.empty(1024)                   # a fake 4 KiB
    ...     b = a.view(32, 32) * 2                  # a view shares it; the product is 4 KiB more
    >>> tracker.peak, isinstance(b, torch._subclasses.fake_tensor.FakeTensor)
    (8192, True)
    """

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
        """Where the bytes are counted."""
        self._inside = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and isinstance(args[0], FakeTensor) and not self.in_kernel_invocation:
            return args[0].fake_device
        if self._inside:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        self._inside = True
        try:
            if any(map(_handles_itself, types)):
                # a wrapper subclass (FSDP2's DTensor) runs the operation on the fake tensors it wraps,
                # which come back here uncounted: its outputs are counted, as a mode above it counts them
                out = func(*args, **(kwargs or {}))
            else:
                out = super().__torch_dispatch__(func, types, args, kwargs or {})
        finally:
            self._inside = False
        self.tracker.count(out)
        return out


_DEVICE = torch.ops.prim.device.default


@functools.cache
def _handles_itself(kind: type) -> bool:
    """A tensor subclass with its own dispatch, which the fake mode leaves to it (not a fake tensor,
    not a plain ``nn.Parameter``)."""
    own = getattr(kind, "__torch_dispatch__", None)
    return not issubclass(kind, FakeTensor) and own is not torch.Tensor.__torch_dispatch__


@contextmanager
def fake_tracking() -> Iterator[StorageTracker]:
    """Fake tensors for the block, every storage they stand for counted in the tracker yielded."""
    tracker = StorageTracker()
    with tracker.resizes(), CountingFakeMode(tracker):
        yield tracker


def optimizer_for(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """The plan's optimizer over ``model``'s trainable parameters, which every flavor's run steps:
    ``adamw`` is torch's AdamW one tensor at a time (its temporaries are the size of the tensor it steps:
    ``exp_avg_sq.sqrt()`` and its quotient); ``adamw-fused`` torch's fused AdamW, which makes none (HF
    Trainer's default, ``--optim adamw_torch_fused``; DeepSpeed's own FusedAdam, built from a JSON
    ``optimizer`` section, makes none either); ``sgd`` SGD with momentum."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def train_two_steps(source: ModelSource, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: Run,
                    tracker: StorageTracker, *, steady: Callable[[], None]) -> None:
    """Two optimizer steps of ``run`` (random tokens, ``run.accumulation`` micro-batches each), each phase
    named in ``tracker``; ``steady`` is called before the second (the steady state a long run repeats)."""
    vocab = max(source.vocab_size, 2)
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        if step == 1:
            steady()
        for _ in range(run.accumulation):
            tokens = torch.randint(0, vocab, (run.micro_batch, run.seq_len), generator=generator)
            tracker.phase = "forward"
            loss = source.loss(model, tokens) / run.accumulation
            tracker.phase = "backward"
            loss.backward()
            del loss, tokens
        tracker.phase = "step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _two_steps(source: ModelSource, model: torch.nn.Module, spec: StrategySpec, run: Run, replay: Replay,
               tracker: StorageTracker, *, skip_repeats: bool) -> Measured:
    """Prepare ``model`` and train two steps of ``run``, counting in ``tracker`` (already entered);
    ``skip_repeats``: leave out optimizer calls that repeat another's memory (``NativeStepper.skip_repeats``:
    fake tensors only)."""
    prepare(model, None, spec, allow_approximate=False, replay=replay, device=torch.device("cpu"))  # in place
    optimizer = optimizer_for(model, run.optimizer)
    engine = model.__dict__["_zerobridge_engine"]
    assert isinstance(engine, Engine)
    engine.stepper.skip_repeats = skip_repeats
    train_two_steps(source, model, optimizer, run, tracker, steady=engine.stats.reset)
    held = engine.memory()
    stats = engine.stats
    return Measured(peaks=dict(tracker.peaks), tiers=dict(held["tier_bytes"]),
                    model_states={"params": held["param_bytes"], "grads": held["grad_bytes"],
                                  "optimizer": held["optimizer_bytes"]},
                    comm_bytes={k: int(v) for k, v in stats.bytes.items() if v},
                    comm_calls={k: int(v) for k, v in stats.calls.items() if v})


def run_once(source: ModelSource, spec: StrategySpec, run: Run, *, layers: int | None = None,
             skip_repeats: bool = True) -> Measured:
    """Two training steps of ``spec`` on ``source`` (``layers`` deep when given) as rank 0 of
    ``run``'s world, on fake tensors. ``ConfigError`` when the engine refuses the layout. ``skip_repeats``:
    optimizer calls that repeat another's memory are left out (the figures are the same, measured in
    ``tests/test_plan.py``)."""
    model = source.build(layers)
    with fake_world(run.world_size, run.ranks_per_node), fake_tracking() as tracker:
        return _two_steps(source, model, spec, run, ShapeReplay(model), tracker, skip_repeats=skip_repeats)


def run_real(source: ModelSource, spec: StrategySpec, run: Run) -> Measured:
    """The same two steps on real tensors in the process group this rank is already in (every rank
    calls it): the model's initial values replayed as an eager build would draw them. What a plan's
    figures are checked against (``bench/plan.py``, ``tests/test_plan.py``)."""
    model = source.build()
    with StorageTracker() as tracker:
        return _two_steps(source, model, spec, run, Replay(model), tracker, skip_repeats=False)
