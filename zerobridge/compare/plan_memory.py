"""``compare --plan-memory``: what ``zerobridge plan`` says each run peaks at, beside what the run measured.

    >>> from zerobridge.compare.plan_memory import FLAVOR_OF
    >>> FLAVOR_OF
    {'native': 'native', 'fsdp': 'fsdp2', 'deepspeed': 'deepspeed'}

Before the runs, each run's spec is planned on its backend's flavor
(``zerobridge.planning.flavors.measure_flavor``: the native engine or the FSDP2
backend trained two steps on fake tensors, DeepSpeed's buffer model) for the
same model, world size, per-rank micro-batch, sequence length, accumulation and
optimizer state; the runs then count their own peaks the same way
(``compare.peaks``). One definition for both: the highest live tensor-storage
bytes on one rank (every device summed, each storage once however many views
it has) over the training steps, what the plan reports as a candidate's peak.

What the plan's run differs in from compare's: it steps AdamW (or SGD with
momentum) in one parameter group where compare's built-in workload has two,
reads one token tensor as inputs and labels where compare's batches are an
``(inputs, targets)`` pair, and does not clip; none of these holds a tensor
the size of a parameter. A run the plan cannot model gets a note in place of
the number: a ``--model`` factory (its own data, loss and optimizer), an
optimizer other than Adam/AdamW or SGD with momentum, a compiled run, a
layout the flavor refuses. The report's side is ``compare.peak_report``; this
module loads the planner's fake runs (FSDP2's among them), so ``compare.api``
imports it only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from zerobridge.compare.peaks import PlannedPeak
from zerobridge.compare.runner import Planned
from zerobridge.errors import ConfigError
from zerobridge.models import preset_named
from zerobridge.planning.fake_run import Run
from zerobridge.planning.flavors import measure_flavor
from zerobridge.planning.models import ModelSource, resolve_model
from zerobridge.planning.worker import program_map
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage

__all__ = ["FLAVOR_OF", "planned_peaks"]

FLAVOR_OF = {"native": "native", "fsdp": "fsdp2", "deepspeed": "deepspeed"}
"""compare's backend -> the plan's flavor that models it."""


def _not_modelled(flavor: str, why: str) -> PlannedPeak:
    return PlannedPeak(flavor, None, f"not modelled: {why}")


def planned_peaks(runs: Sequence[Planned], *, model: str, rows: int, seq_len: int, world_size: int,
                  optimizer: str | None) -> list[PlannedPeak]:
    """Per run: the plan's peak for its spec on its backend's flavor. ``rows``: one rank's rows per
    step (split into ``Planned.accumulation`` micro-batches); ``optimizer``: ``adam`` or ``sgd``
    (``compare.api``'s kind), None for another optimizer."""
    preset = preset_named(model, key="--model")
    source = resolve_model(model) if preset is not None else None
    out: list[PlannedPeak] = []
    for run in runs:
        flavor = FLAVOR_OF.get(run.backend, run.backend)
        if source is None:
            out.append(_not_modelled(flavor, f"--model {model} is a factory with its own data, loss and optimizer; "
                                             "the plan builds the built-in GPT presets"))
        elif optimizer is None:
            out.append(_not_modelled(flavor, "the plan steps Adam/AdamW or SGD with momentum"))
        elif run.spec.compile.enabled:
            out.append(_not_modelled(flavor, "the plan measures eager runs, not torch.compile"))
        else:
            spec = spec_for_stage(run.stage, source.build()) if run.by_stage else run.spec
            shape = Run(world_size=world_size, nodes=1, micro_batch=rows // run.accumulation, seq_len=seq_len,
                        accumulation=run.accumulation, optimizer="sgd" if optimizer == "sgd" else "adamw")
            out.append(_planned(model, source, spec, shape, flavor))
    return out


def _planned(model: str, source: ModelSource, spec: StrategySpec, shape: Run, flavor: str) -> PlannedPeak:
    try:
        if dist.is_available() and dist.is_initialized():  # a plan runs rank 0 of a fake group of its own
            (found,) = program_map(model, [spec], shape, True, flavor, workers=1)
        else:
            found = measure_flavor(source, spec, shape, True, flavor)
    except ConfigError as exc:
        return _not_modelled(flavor, exc.message)
    except Exception as exc:  # the plan cannot run this spec on fake tensors: a cell of the report, not a crash
        first = (str(exc).strip().splitlines() or [""])[0]
        return _not_modelled(flavor, f"the plan's {flavor} fake run fails on this spec ({type(exc).__name__}: "
                                     f"{first}); plan it with zerobridge plan to see the whole error")
    if found.measured is None:
        return _not_modelled(flavor, found.refused or "the flavor refuses this layout")
    peaks = [v for k, v in found.measured.peaks.items() if k != "setup"]
    note = ("closest form: " + "; ".join(found.approximation)) if found.approximation else None
    return PlannedPeak(flavor, max(peaks, default=0), note)
