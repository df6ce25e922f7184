"""One candidate on the FSDP2 backend, run for real on fake tensors: ``fully_shard`` trains two steps as one rank.

    >>> from zerobridge.planning.fake_run import Run
    >>> from zerobridge.planning.fsdp_fake_run import run_fsdp
    >>> from zerobridge.planning.models import resolve_model
    >>> from zerobridge.spec.presets import spec_for_stage
    >>> source = resolve_model("tiny-gpt")
    >>> run = Run(world_size=4, nodes=1, micro_batch=2, seq_len=16)
    >>> measured, approximations = run_fsdp(source, spec_for_stage(3, source.build()), run)
    >>> measured.peaks["backward"] > measured.model_states["params"] > 0, approximations
    (True, ())
    >>> run_fsdp(source, spec_for_stage(2, source.build()), run)[1][0].split(":")[0]
    'sharding'

The same fake world as the native engine's planning run (``fake_run``: rank 0
of a fake process group, fake tensors counted by ``fake_tracking``), but the
model is prepared by zerobridge's FSDP2 backend (``backends/fsdp``: torch's
``fully_shard`` on each wrap unit, its ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy``, the backend's accumulation and clipping rules), so the
figures are FSDP2's own: its padded shards, its all-gather and
reduce-scatter buffers, and no gradient shard kept between steps. torch's
``FSDPMemTracker`` measures FSDP2 the same way. The device mesh is built on
real tensors (``backends/fsdp/kwargs.py``): its rank table is read back as
numbers.

A layout FSDP2 cannot run exactly (ZeRO-1, ZeRO-2's replicated parameters,
one offloaded tier alone) runs as the backend's closest form
(``allow_approximate=True``); the second value lists what was approximated,
as the backend reports it, so the plan marks the row instead of planning it
on another engine.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zerobridge.backends.base import backend_of
from zerobridge.backends.fsdp.backend import FsdpBackend
from zerobridge.backends.fsdp.prepare import judged, prepare
from zerobridge.errors import ConfigError
from zerobridge.planning.fake_run import Measured, Run, fake_tracking, fake_world, optimizer_for, train_two_steps
from zerobridge.planning.models import ModelSource
from zerobridge.runtime.deferred_init import ShapeReplay
from zerobridge.runtime.plan import run_fields
from zerobridge.spec import StrategySpec

__all__ = ["FsdpForm", "fsdp_form", "run_fsdp"]


@dataclass(frozen=True)
class FsdpForm:
    """What the FSDP2 backend runs for a spec, before it runs."""

    key: str
    """Everything the backend reads from the spec (``fully_shard``'s form, the run rules, compile), as one
    string: two specs with the same key train alike on one model and world, so a plan measures the form
    once (ZeRO-1, ZeRO-2 and ZeRO-2 with its optimizer offloaded are one form)."""
    notes: tuple[str, ...]
    """What the form runs differently from the spec (``key: note``), as ``run_fsdp`` returns it, less what
    only the model shows (a unit merged into its enclosing one)."""


def fsdp_form(spec: StrategySpec, run: Run) -> FsdpForm | None:
    """``spec``'s FSDP2 form on ``run``'s world; ``None`` when the backend refuses it there."""
    try:
        rules, assessment = judged(spec, world_size=run.world_size, local_world_size=run.ranks_per_node)
    except ConfigError:
        return None
    form = copy.deepcopy(assessment.form)
    read = {"form": form, "rules": {k: repr(v) for k, v in run_fields(rules).items() if k != "spec"},
            "compile": spec.compile.model_dump(mode="json")}
    if rules.accumulation_steps == 1:  # every micro-batch ends a step: when gradients synchronize is moot
        del read["rules"]["grad_sync"]
        form.get("training_loop", {}).pop("grad_sync", None)
    return FsdpForm(json.dumps(read, sort_keys=True, default=repr),
                    tuple(_note(e.key, e.note) for e in assessment.approximations))


def _note(key: str, note: str) -> str:
    """One approximation as the plan shows it (``key: note``): ``fsdp_form`` and ``run_fsdp`` write it
    alike, so ``flavors.measure_once`` can tell a form's notes from the model's."""
    return f"{key}: {note}"


def run_fsdp(source: ModelSource, spec: StrategySpec, run: Run, *, layers: int | None = None
             ) -> tuple[Measured, tuple[str, ...]]:
    """Two training steps of ``spec`` on the FSDP2 backend as rank 0 of ``run``'s world, on fake
    tensors; and what FSDP2 ran differently from ``spec`` (``key: note``, empty when exact).
    ``ConfigError`` when FSDP2 cannot run the layout even approximately (NVMe)."""
    model = source.build(layers)
    with fake_world(run.world_size, run.ranks_per_node), fake_tracking() as tracker:
        optimizer = optimizer_for(model, run.optimizer)
        prepared = prepare(model, optimizer, spec, allow_approximate=True, replay=ShapeReplay(model),
                           device=torch.device("cpu"))
        assert isinstance(prepared, tuple)
        module, optimizer = prepared
        backend = backend_of(module)
        assert isinstance(backend, FsdpBackend)
        # the mesh's rank table is a real tensor (``device_mesh_from_form`` builds it outside the fake
        # mode, so none of its operations reached the tracker); a real run counts it (from its setup phase on,
        # which no figure reads: here from the end of setup)
        with unset_fake_temporarily():
            tracker.adopt([backend.mesh.mesh])
        every = [group["params"] for group in optimizer.param_groups]

        def steady() -> None:
            backend.reset_stats()
            _one_of_each_kind(optimizer)

        train_two_steps(source, module, optimizer, run, tracker, steady=steady)
        for group, params in zip(optimizer.param_groups, every):
            group["params"] = params
        optimizer.zero_grad(set_to_none=True)  # the gradients of those left out, as the step's own zero_grad
        held = backend.stats()
    measured = Measured(peaks=dict(tracker.peaks), tiers=dict(held["tier_bytes"]),
                        model_states={"params": held["param_bytes"], "grads": held["grad_bytes"],
                                      "optimizer": held["optimizer_bytes"]},
                        comm_bytes={k: int(v) for k, v in held["comm_bytes"].items() if v},
                        comm_calls={k: int(v) for k, v in held["comm_calls"].items() if v})
    return measured, tuple(_note(a["key"], a["note"]) for a in held["approximations"])


def _one_of_each_kind(optimizer: torch.optim.Optimizer) -> None:
    """From the second step on, ``optimizer`` steps one parameter of each kind (shape, dtype, device and
    placements, in each of its groups): the figures are the same, in fewer operations (fake tensors
    only). Every parameter's state exists from the first step, and a tensor-at-a-time optimizer's
    temporaries are those of the tensor it steps, freed before the next, so the step's peak is the
    largest kind's wherever it comes; a fused step makes none. The native engine leaves its repeats
    out the same way (``NativeStepper.skip_repeats``)."""
    for group in optimizer.param_groups:
        kinds: dict[tuple[object, ...], torch.Tensor] = {}
        for param in group["params"]:
            kind = (tuple(param.shape), param.dtype, param.device, tuple(getattr(param, "placements", ())))
            kinds.setdefault(kind, param)
        group["params"] = list(kinds.values())
