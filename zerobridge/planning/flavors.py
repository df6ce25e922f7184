"""Which engine a plan measures a candidate on: the native engine, FSDP2, or DeepSpeed's memory model.

    >>> from zerobridge.planning.flavors import FLAVORS, flavor_for_target
    >>> FLAVORS, flavors_named("all")
    (('native', 'fsdp2', 'deepspeed'), ('native', 'fsdp2', 'deepspeed'))
    >>> flavor_for_target("accelerate-deepspeed"), flavor_for_target("torchtitan"), flavor_for_target("spec")
    ('deepspeed', 'fsdp2', 'native')

- ``native``: zerobridge's engine on fake tensors (``fake_run``), exact for it.
- ``fsdp2``: zerobridge's FSDP2 backend (torch ``fully_shard``) on fake tensors
  (``fsdp_fake_run``); a layout FSDP2 has no exact form for (ZeRO-1, ZeRO-2)
  runs as the backend's closest form, and the row says which.
- ``deepspeed``: the native run of the same layout plus DeepSpeed's own buffers
  (``deepspeed_memory``: real DeepSpeed does not run on fake tensors), sized
  from the JSON ``--to deepspeed`` writes; stages 1 to 3 on one group without
  offload; other candidates are left out of that flavor's plan, with the reason.

A candidate a flavor cannot run is ``refused`` with a ``cell`` saying which
way (``NOT_EXPRESSIBLE``: the flavor has no form for it; ``NOT_MODELLED``: it
has one, and the plan cannot measure it there); the plan shows that cell in the
flavor's column, never another flavor's figure (``--flavor all``).

A candidate deeper than ``FULL_DEPTH`` blocks is measured at ``SHALLOW`` depths
and extended, on every flavor alike (``measure``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from zerobridge.errors import ConfigError
from zerobridge.planning.deepspeed_memory import run_deepspeed
from zerobridge.planning.fake_run import Measured, Run, run_once
from zerobridge.planning.fsdp_fake_run import FsdpForm, fsdp_form, run_fsdp
from zerobridge.planning.measure import FULL_DEPTH, SHALLOW, extend
from zerobridge.planning.models import ModelSource, resolve_model
from zerobridge.spec import StrategySpec

__all__ = ["ALL", "FLAVORS", "NOT_EXPRESSIBLE", "NOT_MODELLED", "FlavorMeasured", "flavor_for_target",
           "flavors_named", "measure_flavor", "measure_flavor_ref", "measure_once"]

FLAVORS = ("native", "fsdp2", "deepspeed")
"""The engines a plan can measure on (``--flavor``)."""
ALL = "all"
"""``--flavor all``: every flavor of ``FLAVORS``, one column each."""
NOT_EXPRESSIBLE = "not expressible"
"""The cell of a candidate the flavor has no form for, not even an approximate one."""
NOT_MODELLED = "not modelled"
"""The cell of a candidate the flavor runs, and the plan cannot measure there (DeepSpeed's model, a fake run
that fails)."""
_REFUSED_AS = {"fsdp2": NOT_EXPRESSIBLE, "deepspeed": NOT_MODELLED}

_TARGET_FLAVOR = {"deepspeed": "deepspeed", "accelerate-deepspeed": "deepspeed", "trainer-deepspeed": "deepspeed",
                  "fsdp2": "fsdp2", "torchtitan": "fsdp2", "accelerate-fsdp": "fsdp2", "lightning": "fsdp2",
                  "trainer-fsdp": "fsdp2", "fsdp1": "fsdp2"}
"""``--to`` format -> the flavor that runs it (FSDP1 and Lightning's FSDP are measured as FSDP2)."""

Runner = Callable[[ModelSource, StrategySpec, Run, "int | None"], tuple[Measured, tuple[str, ...]]]


@dataclass(frozen=True)
class FlavorMeasured:
    """One candidate on one flavor: its figures, or why that flavor cannot plan it."""

    measured: Measured | None
    approximation: tuple[str, ...] = ()
    """What the flavor ran instead of the spec (``key: note``); empty when exact."""
    refused: str | None = None
    """Why the flavor cannot plan it (``measured`` is then ``None``)."""
    cell: str | None = None
    """What the flavor's column shows in place of a peak: ``NOT_EXPRESSIBLE`` or ``NOT_MODELLED``."""


def flavor_for_target(target: str) -> str:
    """The flavor a ``--to`` format runs on (``native`` for zerobridge's own ``spec``)."""
    return _TARGET_FLAVOR.get(target, "native")


def flavors_named(flavor: str) -> tuple[str, ...]:
    """The flavors ``--flavor FLAVOR`` measures (``all``: every one); ``ConfigError`` naming the choices."""
    if flavor == ALL:
        return FLAVORS
    if flavor not in FLAVORS:
        raise ConfigError(f"--flavor {flavor!r}", key="--flavor", fix=f"use one of {', '.join(FLAVORS)} or {ALL}")
    return (flavor,)


def _native(source: ModelSource, spec: StrategySpec, run: Run, layers: int | None) -> tuple[Measured, tuple[str, ...]]:
    return run_once(source, spec, run, layers=layers), ()


def _fsdp2(source: ModelSource, spec: StrategySpec, run: Run, layers: int | None) -> tuple[Measured, tuple[str, ...]]:
    return run_fsdp(source, spec, run, layers=layers)


def _deepspeed(source: ModelSource, spec: StrategySpec, run: Run, layers: int | None
               ) -> tuple[Measured, tuple[str, ...]]:
    return run_deepspeed(source, spec, run, layers=layers)[0], ()


_RUNNERS: dict[str, Runner] = {"native": _native, "fsdp2": _fsdp2, "deepspeed": _deepspeed}


def measure_flavor(source: ModelSource, spec: StrategySpec, run: Run, whole: bool, flavor: str) -> FlavorMeasured:
    """Two fake steps of ``spec`` on ``flavor``: whole up to ``FULL_DEPTH`` blocks (or ``whole``), else at
    ``SHALLOW`` depths, extended. A layout the flavor cannot run is returned as refused (native: raised)."""
    runner = _RUNNERS[flavor]
    try:
        with warnings.catch_warnings():
            # a plan measures training: a model whose config keeps a KV cache is planned as trained, without it
            warnings.filterwarnings("ignore", message="activation checkpointing: .* dropped")
            if whole or source.layers is None or source.layers <= FULL_DEPTH:
                measured, notes = runner(source, spec, run, None)
                return FlavorMeasured(measured, notes)
            (low, notes), (high, _) = (runner(source, spec, run, d) for d in SHALLOW)
    except ConfigError as exc:
        if flavor == "native":
            raise
        return FlavorMeasured(None, refused=exc.message, cell=_REFUSED_AS[flavor])
    except Exception as exc:  # the flavor's own code fails on fake tensors: a cell of its column, not a crash
        if flavor == "native":
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return FlavorMeasured(None, refused=f"its fake run fails on this layout ({type(exc).__name__}: {first})",
                              cell=NOT_MODELLED)
    return FlavorMeasured(extend(low, high, SHALLOW, source.layers), notes)


def measure_flavor_ref(ref: str, spec: StrategySpec, run: Run, whole: bool, flavor: str) -> FlavorMeasured:
    """``measure_flavor`` in a worker process: the model named again there (a source does not pickle)."""
    return measure_flavor(resolve_model(ref), spec, run, whole, flavor)


def _key(spec: StrategySpec, flavor: str, form: FsdpForm | None) -> str:
    """What decides a job's figures: FSDP2's form of the spec (``fsdp_form``), else the spec itself."""
    return f"{flavor}:{form.key if form is not None else spec.model_dump_json()}"


def measure_once(jobs: Sequence[tuple[StrategySpec, str]], run: Run,
                 measure: Callable[[list[tuple[StrategySpec, str]]], list[FlavorMeasured]]) -> list[FlavorMeasured]:
    """Every (spec, flavor) of ``jobs`` measured, each run that trains alike measured once by ``measure``
    (FSDP2's closest forms: its ZeRO-1, ZeRO-2 and ZeRO-2 with the optimizer offloaded are one run);
    a repeat takes that run's figures with its own approximation notes."""
    forms = [fsdp_form(spec, run) if flavor == "fsdp2" else None for spec, flavor in jobs]
    first: dict[str, int] = {}
    owner = [first.setdefault(_key(spec, flavor, form), i) for i, ((spec, flavor), form) in
             enumerate(zip(jobs, forms))]
    unique = sorted(set(owner))
    measured = dict(zip(unique, measure([jobs[i] for i in unique])))
    out = []
    for i, o in enumerate(owner):
        m = measured[o]
        form, its = forms[i], forms[o]
        if o != i and form is not None and its is not None:
            from_model = tuple(n for n in m.approximation if n not in its.notes)  # a merged unit: same model
            m = replace(m, approximation=form.notes + from_model)
        out.append(m)
    return out
