"""The spec's ``compile`` in every format: read and written where the format has a form, reported where not.

    >>> from zerobridge.spec import StrategySpec
    >>> from zerobridge.spec.compilation import CompileSpec
    >>> from zerobridge.translate.compilation import write_dynamo
    >>> from zerobridge.translate.report import Report
    >>> spec = StrategySpec(compile=CompileSpec(enabled=True, scope="model", dynamic=False))
    >>> write_dynamo(spec, Report(source="spec", target="accelerate-fsdp"), deepspeed=False)["dynamo_backend"]
    'INDUCTOR'

Forms: Accelerate's ``dynamo_config`` (read and written), torchtitan's
``[compile]`` and older ``training.compile`` (read), the ``compile`` keys older
DeepSpeed releases read (read; DeepSpeed 0.19.8 rejects them, so a compiled
spec is reported with the ``engine.compile`` call instead). FSDP1/FSDP2
keyword arguments and Lightning strategy names have no form: ``no_compile_form``.
"""

from __future__ import annotations

from typing import Any

from zerobridge.spec import StrategySpec
from zerobridge.spec.compilation import CompileScope, CompileSpec
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Report, Status

__all__ = ["compile_call", "no_compile_form", "read_deepspeed_compile", "read_dynamo", "read_torchtitan_compile",
           "write_deepspeed_compile", "write_dynamo"]

_DYNAMO = "dynamo_config."
_BACKEND = _DYNAMO + "dynamo_backend"
_DYNAMO_FIELDS = {"dynamo_mode": "mode", "dynamo_use_fullgraph": "fullgraph", "dynamo_use_dynamic": "dynamic"}
_REGIONAL = _DYNAMO + "dynamo_use_regional_compilation"
_DEEPSPEED_RUNS = ("accelerate launch passes no dynamo setting to a DeepSpeed run (its DeepSpeed environment has no "
                   "ACCELERATE_DYNAMO_* variables), so Accelerator compiles nothing; pass "
                   "Accelerator(dynamo_plugin=TorchDynamoPlugin(...)) in code or export ACCELERATE_DYNAMO_BACKEND")
_REGIONAL_NOTE = ("regional compilation compiles each of the model's repeated blocks on its own and the other leaf "
                  "modules separately; the spec's units scope compiles each innermost wrap unit and runs the rest "
                  "eagerly")


def compile_call(compile: CompileSpec) -> str:
    """``torch.compile(...)`` with the spec's arguments and what it is applied to, for report notes."""
    args = ", ".join(f"{name}={value!r}" for name, value in compile.kwargs().items())
    where = "on each innermost wrap unit" if compile.scope is CompileScope.UNITS else "on the whole model"
    return f"torch.compile({args}) {where}"


def no_compile_form(spec: StrategySpec, report: Report, how: str) -> None:
    """Report ``spec.compile`` for a target with no compile setting: not expressible when on
    (``how`` names the form that works), equivalent when off with other settings, silent at the default."""
    compile = spec.compile
    if compile == CompileSpec():
        return
    if not compile.enabled:
        report.add("compile", Status.EQUIVALENT, "compile is off: its other settings change nothing; not written")
        return
    report.add("compile", Status.NOT_EXPRESSIBLE, f"{compile_call(compile)} has no form here: {how}")


# ---------------------------------------------------------------------------------------------- DeepSpeed

def read_deepspeed_compile(keys: SourceKeys) -> dict[str, Any]:
    """The spec's ``compile`` from the keys older DeepSpeed releases read in the ``compile`` section."""
    on, off = "compile.enabled", "compile.disable"
    if keys.given(on) and keys.given(off):
        raise keys.error(off, "compile.enabled and compile.disable are both given (two older DeepSpeed releases' "
                              "names for one switch)", fix="keep one of them")
    fields: dict[str, Any] = {}
    if keys.given(on):
        fields["enabled"] = keys.get(on)
    elif keys.given(off):
        fields["enabled"] = not keys.get(off)
        keys.note(off, extra=f"read as enabled = {str(fields['enabled']).lower()}")
    for name in ("backend", "mode", "fullgraph"):
        if keys.given(f"compile.{name}"):
            fields[name] = keys.get(f"compile.{name}")
    if keys.given("compile.dynamic"):
        dynamic = keys.values["compile.dynamic"]
        if dynamic not in (True, False, None):
            raise keys.error("compile.dynamic", f"expected true, false or null, got {dynamic!r}",
                             fix="write true, false or null (torch decides)")
        fields["dynamic"] = dynamic
    if fields.get("enabled"):
        fields["scope"] = CompileScope.MODEL
        keys.report.add("compile", Status.EXACT, "DeepSpeed compiles the engine's whole module", target="compile.scope")
    for path in (on, "compile.backend", "compile.kwargs", "compile.mode", "compile.fullgraph", "compile.dynamic",
                 "compile.options"):
        if keys.given(path):
            keys.note(path)
    return fields


def write_deepspeed_compile(spec: StrategySpec, report: Report) -> None:
    """DeepSpeed 0.19.8's ``compile`` section has no switch; the report names the call that compiles."""
    c = spec.compile
    kwargs = {k: v for k, v in c.kwargs().items() if k != "backend"}
    call = f"engine.compile(backend={c.backend!r}, compile_kwargs={kwargs!r})"
    if c.scope is CompileScope.UNITS:
        call += " (the whole module; per unit, call module.compile(...) on each unit's module)"
    no_compile_form(spec, report, "DeepSpeed 0.19.8's compile section holds only DeepCompile options and rejects "
                                  f"enabled/backend; after deepspeed.initialize call {call}; zerobridge's deepspeed "
                                  "backend compiles when compile.enabled; through Accelerate, set dynamo_config")


# ---------------------------------------------------------------------------------------------- Accelerate

def read_dynamo(keys: SourceKeys, *, deepspeed: bool) -> dict[str, Any] | None:
    """The spec's ``compile`` from ``dynamo_config`` or the older top-level ``dynamo_backend``,
    as ``accelerate launch`` passes them to ``TorchDynamoPlugin``; None when neither is given
    or the launcher drops them (``deepspeed``: a DeepSpeed run)."""
    paths = [row.path for row in keys.table.rows if row.path.startswith(_DYNAMO)]
    given = [path for path in paths if keys.given(path)]
    if not given:
        return None
    if keys.key(_BACKEND) == "dynamo_backend" and len(given) > 1:
        raise keys.error(_BACKEND, "the older top-level dynamo_backend is given beside dynamo_config, which "
                                   "Accelerate then replaces with it", fix="move it into dynamo_config")
    values = {path: keys.get(path) for path in paths}  # the plugin checks every value, NO or not
    backend: str = values[_BACKEND]
    if backend == "NO":
        for path in given:
            keys.note(path, Status.EXACT, "" if path == _BACKEND else "unused: dynamo_backend is NO")
        return {"enabled": False}
    if deepspeed:
        for path in given:
            keys.note(path, Status.IGNORED, _DEEPSPEED_RUNS)
        return None
    # The launcher exports every dynamo setting, its defaults included, so absent keys are its defaults.
    fields: dict[str, Any] = {"enabled": True, "backend": backend.lower()}
    for key, name in _DYNAMO_FIELDS.items():
        fields[name] = values[_DYNAMO + key]
    regional = values[_REGIONAL]
    fields["scope"] = CompileScope.UNITS if regional else CompileScope.MODEL
    for path in paths:
        keys.note(path, Status.EQUIVALENT if path == _REGIONAL and regional else None,
                  _REGIONAL_NOTE if path == _REGIONAL and regional else "")
    return fields


def write_dynamo(spec: StrategySpec, report: Report, *, deepspeed: bool) -> dict[str, Any] | None:
    """The ``dynamo_config`` section for ``spec.compile`` (None when compile is off, or in a
    DeepSpeed config, whose runs the launcher does not compile)."""
    c = spec.compile
    backends = load_table("accelerate").row(_BACKEND).values
    if not c.enabled or deepspeed:
        no_compile_form(spec, report, _DEEPSPEED_RUNS)
        return None
    if c.backend.upper() not in backends or c.backend.upper() == "NO":
        report.add("compile", Status.NOT_EXPRESSIBLE, f"Accelerate's dynamo_backend has no {c.backend!r} (it takes "
                   f"{', '.join(b.lower() for b in backends[1:])}): compile the model in the training script",
                   target=_BACKEND)
        return None
    units = c.scope is CompileScope.UNITS
    report.add("compile", Status.EXACT, compile_call(c), target="dynamo_config")
    if units:
        report.add("compile.scope", Status.EQUIVALENT, _REGIONAL_NOTE, target=_REGIONAL)
    if c.dynamic is None:
        report.add("compile.dynamic", Status.APPROXIMATED, "accelerate launch passes dynamic=False unless "
                   "dynamo_use_dynamic is true: torch's None (mark dimensions dynamic after a shape changes) has "
                   "no launcher form", target=_DYNAMO + "dynamo_use_dynamic")
    return {"dynamo_backend": c.backend.upper(), "dynamo_mode": c.mode.value, "dynamo_use_fullgraph": c.fullgraph,
            "dynamo_use_dynamic": bool(c.dynamic), "dynamo_use_regional_compilation": units}


# ---------------------------------------------------------------------------------------------- torchtitan

def read_torchtitan_compile(keys: SourceKeys, *, per_block: bool) -> dict[str, Any]:
    """The spec's ``compile`` from ``[compile]`` (or the older ``training.compile``): torchtitan compiles
    every TransformerBlock with ``fullgraph=True``; ``per_block``: the spec's units are those blocks."""
    enable, components, backend = "compile.enable", "compile.components", "compile.backend"
    on = keys.get(enable)
    parts = keys.get(components)
    if not isinstance(parts, (list, tuple)) or not all(part in ("model", "loss") for part in parts):
        raise keys.error(components, f"expected a list of 'model' and 'loss', got {parts!r} (torchtitan raises)",
                         fix='write components = ["model", "loss"] or one of them')
    name = keys.get(backend)
    if not isinstance(name, str) or not name.strip():
        raise keys.error(backend, f"expected a torch.compile backend name, got {name!r}", fix='write "inductor"')
    older = keys.key(enable) == "training.compile"  # compiled the blocks only; components came later
    model = bool(on) and (older or "model" in parts)
    if keys.given(enable):
        how = "every TransformerBlock compiled with fullgraph=True: scope units, fullgraph" if per_block else \
            "without FSDP the spec has one unit, the whole model, compiled as one graph; torchtitan compiles " \
            "each TransformerBlock"
        keys.note(enable, None if per_block or not model else Status.EQUIVALENT, how if model else "")
    if on and not older and "loss" in parts:
        keys.note(components, Status.NOT_EXPRESSIBLE, "the loss function is compiled too, which the spec does not "
                  "describe: compile it in the training script")
    elif keys.given(components):
        keys.note(components, Status.EXACT, "" if model else "unused: compile is off")
    if keys.given(backend):
        keys.note(backend, None if on else Status.EXACT, "" if on else "unused: compile is off")
    if not model:
        return {"enabled": False, "backend": name}
    return {"enabled": True, "backend": name, "scope": CompileScope.UNITS, "fullgraph": True}
