"""Mixed precision at the formula: live model-state bytes ÷ the ZeRO formula of each layout,
on the tiny GPT at 20M and 100M parameters, world 2.

    python bench/mixed_precision.py              # about 15 min on 2 cores
    python bench/mixed_precision.py --render     # rewrite the docs table from the saved JSON

Per preset, in one 2-process gloo group (the same weights, batches, AdamW and clipping
at 1.0), the native engine runs

- bf16 and fp16 (dynamic loss scaling) in DeepSpeed's layout (``compute_copy="stored"``:
  16-bit parameters and gradients beside an fp32 master) at stages 0-3;
- bf16 and fp16 in FSDP's layout (``compute_copy="gathered"``, fp32 gradients) at stage 3;

and real FSDP2 (``backend="fsdp"``) runs the bf16 FSDP-layout spec. For each run, on the
last step: the live tensor storages (garbage-collector scan, the same for every engine)
beyond those alive before the model was built, after backward and again once clipping
asked for the gradients (the optimizer's fp32 gradient copy exists then), divided by the
formula ``zerobridge explain`` gives for the spec. Activations are freed by then; what
is left besides model state is a few batch rows and small buffers. Writes
``bench/results/mixed_precision.json`` and the table between the markers in
``docs/benchmarks.md`` (a test checks that the table matches the JSON). fp16 matmuls
are slow on CPU: most of the time goes to the fp16 runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from backends import ROOT, SHAPES, measured_line, preset_main, splice  # noqa: F401  (splice: tests render the block)

BEGIN, END = "<!-- bench/mixed_precision.py: begin -->", "<!-- bench/mixed_precision.py: end -->"
RESULTS = ROOT / "bench" / "results" / "mixed_precision.json"
DOC = ROOT / "docs" / "benchmarks.md"


def _configs(folder: Path) -> list[Path]:
    """Spec files: ``<dtype>-<layout>-z<stage>``."""
    from zerobridge.spec import DynamicLossScale, PrecisionSpec
    from zerobridge.spec.presets import spec_for_stage

    paths = []
    cases = [(d, "stored", s) for d in ("bf16", "fp16") for s in (0, 1, 2, 3)]
    cases += [(d, "gathered", 3) for d in ("bf16", "fp16")]
    for dtype, layout, stage in cases:
        grads = {"reduce_dtype": "fp32", "accumulate_dtype": "fp32"} if layout == "gathered" else {}
        scaling = {"loss_scaling": DynamicLossScale(initial_scale=2.0**12)} if dtype == "fp16" else {}
        precision = PrecisionSpec(param_dtype=dtype, master_dtype="fp32", compute_copy=layout, **grads, **scaling)
        spec = spec_for_stage(stage).model_copy(update={"precision": precision})
        path = folder / f"{dtype}-{layout}-z{stage}.json"
        path.write_text(json.dumps(spec.model_dump(mode="json")))
        paths.append(path)
    return paths


def measure(preset: str, steps: int) -> dict[str, Any]:
    """Every spec on the native engine, the FSDP-layout bf16 spec on FSDP2 too, in one 2-rank group."""
    from zerobridge.explain import explain
    from zerobridge.harness.cluster import Cluster
    from zerobridge.load import load_spec

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder, Cluster(2, timeout_s=1800) as cluster:
        configs = _configs(Path(folder))
        runs = [("native", c) for c in configs] + [("fsdp", c) for c in configs if c.stem == "bf16-gathered-z3"]
        for backend, config in runs:
            spec = load_spec(config).value
            ranks = cluster.run("zerobridge.testing.measure:gpt_model_state", preset=preset,
                                spec=spec, backend=backend, steps=steps, **SHAPES[preset])
            params = ranks[0]["params"]
            told = explain(spec, params=params, world_size=2)
            row = {key: max(r[key] for r in ranks) for key in ("after_backward", "at_step")}
            out["params"] = params
            out[f"{backend}/{config.stem}"] = {**row, "formula": told.formula, "formula_bytes": told.model_state_bytes,
                                              **{f"{k}_vs_formula": v / told.model_state_bytes for k, v in row.items()}}
            print(f"  {backend}/{config.stem}: {row['after_backward'] / told.model_state_bytes:.3f} after backward, "
                  f"{row['at_step'] / told.model_state_bytes:.3f} at the step", file=sys.stderr, flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    """The Markdown block ``docs/benchmarks.md`` carries between its markers."""
    presets = results["presets"]
    lines = [measured_line(results, f"world 2 (gloo), AdamW, {results['steps']} steps, the largest rank's live "
                                    "tensor storages on the last step beyond those alive before the model was "
                                    "built"), "",
             "| engine / spec | formula | " + " | ".join(
                 f"{p} ({presets[p]['params'] / 1e6:.0f}M): live after backward ÷ formula | {p}: live at the step "
                 "÷ formula" for p in presets) + " |",
             "|---|---|" + "---|---|" * len(presets)]
    names = [n for n in presets[next(iter(presets))] if n != "params"]
    for name in names:
        first = presets[next(iter(presets))][name]
        cells = " | ".join(f"{row[name]['after_backward_vs_formula']:.3f} | {row[name]['at_step_vs_formula']:.3f}"
                           for row in presets.values())
        lines.append(f"| {name} | {first['formula']} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    return preset_main(__file__, __doc__, steps=2, path=RESULTS, table_of=table, markers=(BEGIN, END),
                       measure=lambda presets, steps: {"presets": {p: measure(p, steps) for p in presets}})


if __name__ == "__main__":
    raise SystemExit(main())
