"""Each flavor's planned peak against that flavor's real peak, and each flavor's real peak against the
native engine's on the same cell: the two tables under "Flavors" in docs/plan.md.

    python bench/plan_flavors.py          # about 6 min on 2 CPU cores; bench/results/plan_flavors.json
    python bench/plan_flavors.py --models tiny-gpt:20m --world-size 4 -o other.json
    python bench/plan_flavors.py --flavors deepspeed --candidates zero1 zero1+ac -o stage1.json
    python bench/plan_flavors.py --table bench/results/plan_flavors.json   # docs/plan.md's tables, nothing run
    python bench/plan_flavors.py --optimizer adamw-fused -o bench/results/plan_flavors_fused.json

Cells: the tiny Llama and a 3-layer Qwen2 config (``QWEN2``), stages 1 to 3
with and without activation checkpointing (``CANDIDATES``, or ``--candidates``),
fp32 and bf16, world 2, 2 x 128 tokens per rank. Real:
``zerobridge.testing.flavor_peaks`` on gloo (real DeepSpeed with the JSON
``plan --to deepspeed`` writes, on its CPU accelerator; the FSDP2 backend,
ZeRO-1 and ZeRO-2 as its closest forms), the busier
rank's peak of the training phases counted by the plan's ``StorageTracker``.
Planned: ``planning.flavors.measure_flavor`` on fake tensors, the figure
``zerobridge plan --flavor`` shows. Native: the native engine's real peak on
the same cell (``zerobridge.testing.plan_measure``, the same counter), the
denominator of the cross-flavor table (``--native``, on by default). Beside
each flavor's plan, that flavor's own estimator against the same real peak
(``zerobridge.testing.estimators``): DeepSpeed's for its stages 2 and 3,
``accelerate estimate-memory`` for FSDP2. One launch per flavor and model. A
script, not a test (``tests/test_plan_flavors.py`` asserts a subset).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from zerobridge.harness.cluster import Cluster
from zerobridge.planning.candidates import candidates, deepspeed_form
from zerobridge.planning.deepspeed_memory import deepspeed_config
from zerobridge.planning.fake_run import Run
from zerobridge.planning.flavors import measure_flavor
from zerobridge.planning.models import resolve_model
from zerobridge.spec import StrategySpec
from zerobridge.testing.estimators import accelerate_estimate, deepspeed_estimate, estimator_sizes
from zerobridge.testing.flavor_peaks import TRAINING
from zerobridge.translate.run_level import with_run_settings

REPO = Path(__file__).resolve().parents[1]
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
MICRO_BATCH, SEQ_LEN = 2, 128
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 352,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
         "max_position_embeddings": 512, "tie_word_embeddings": True}
CANDIDATES = ("zero1", "zero2", "zero3", "zero1+ac", "zero2+ac", "zero3+ac")
PRECISIONS = ("fp32", "bf16")


def _specs(model: str, flavor: str, world: int, names: tuple[str, ...] = CANDIDATES) -> dict[str, StrategySpec]:
    template = resolve_model(model).build()
    made = {c.name: c.spec for c in candidates(template, nodes=1, ranks_per_node=world)}
    out = {}
    for precision in PRECISIONS:
        for name in names:
            spec = with_run_settings(made[name], micro_batch=MICRO_BATCH, accumulation=1, precision=precision).value
            if flavor == "deepspeed":
                spec = deepspeed_form(spec, template, own=False)[0]
            out[f"{name}/{precision}"] = spec
    return out


def _real(model: str, flavor: str, specs: dict[str, StrategySpec], world: int, optimizer: str) -> dict[str, int]:
    run = {"model": model, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "optimizer": optimizer}
    if flavor == "deepspeed":
        template = resolve_model(model).build()
        extra = {"zero_allow_untested_optimizer": True, "steps_per_print": 2**62}
        configs = {k: deepspeed_config(s, template, world) | extra for k, s in specs.items()}
        with Cluster(world, timeout_s=900, env=ENV) as cluster:
            ranks: list[Any] = cluster.run("zerobridge.testing.flavor_peaks:deepspeed_peaks", configs=configs,
                                           recompute=tuple(k for k in configs if "+ac" in k), **run)
    else:
        with Cluster(world, timeout_s=900) as cluster:
            ranks = cluster.run("zerobridge.testing.flavor_peaks:fsdp_peaks", clip=None, approximate=True,
                                specs={k: s.model_dump(mode="json") for k, s in specs.items()}, **run)
    return {k: max(r[k]["train"] for r in ranks) for k in specs}


def _native(model: str, world: int, names: tuple[str, ...], optimizer: str) -> dict[str, int]:
    """The native engine's real peak of the training phases per cell, the busier rank's."""
    specs = _specs(model, "native", world, names)
    out: dict[str, int] = {}
    with Cluster(world, timeout_s=900) as cluster:
        for key, spec in specs.items():
            ranks: list[Any] = cluster.run("zerobridge.testing.plan_measure:measure", model=model,
                                           spec=spec.model_dump(mode="json"), micro_batch=MICRO_BATCH,
                                           seq_len=SEQ_LEN, optimizer=optimizer)
            out[key] = max(max(r["peaks"].get(p, 0) for p in TRAINING) for r in ranks)
    return out


def _planned(model: str, flavor: str, specs: dict[str, StrategySpec], world: int, optimizer: str
             ) -> dict[str, int | None]:
    """The plan's peak per cell; ``None`` where the flavor leaves the candidate out (not modelled)."""
    source = resolve_model(model)
    run = Run(world_size=world, nodes=1, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, optimizer=optimizer)
    out: dict[str, int | None] = {}
    for key, spec in specs.items():
        measured = measure_flavor(source, spec, run, False, flavor).measured
        out[key] = None if measured is None else max(measured.peaks.get(p, 0) for p in TRAINING)
    return out


def table(result: dict[str, Any]) -> str:
    """The Markdown table docs/plan.md shows, from a results JSON: a row per model, candidate and dtype, each
    flavor's real peak and its plan's error (``~``: FSDP2 ran its closest form; ``not modelled``: no plan)."""
    cells: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        name, dtype = row["cell"].split("/")
        cells.setdefault((row["model"], name, dtype), {})[row["flavor"]] = row
    lines = ["| model | candidate | dtype | real DeepSpeed | DeepSpeed plan | DeepSpeed's estimator | real FSDP2 "
             "| FSDP2 plan | accelerate estimate |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, name, dtype), by_flavor in cells.items():
        shown = []
        for flavor in ("deepspeed", "fsdp2"):
            row = by_flavor.get(flavor)
            if row is None:
                shown += ["-", "-", "-"]
                continue
            error = "not modelled" if row["error"] is None else f"{row['error']:+.1%}"
            estimate = row.get("estimate_error")
            shown += [f"{row['real_bytes'] / 2**20:.1f} MiB", error, "n/a" if estimate is None else f"{estimate:+.1%}"]
        mark = " (FSDP2: ~)" if name.split("+")[0] in ("zero1", "zero2") and "fsdp2" in by_flavor else ""
        lines.append(f"| {model} | {name}{mark} | {dtype} | " + " | ".join(shown) + " |")
    errors = [abs(r["error"]) for r in result["rows"] if r["error"] is not None]
    by = {f: [r["error"] for r in result["rows"] if r["flavor"] == f and r["error"] is not None]
          for f in ("deepspeed", "fsdp2")}
    summary = "; ".join(f"{f}: {len(e)} cells, {min(e):+.1%} .. {max(e):+.1%}" for f, e in by.items() if e)
    return "\n".join(lines) + f"\n\n{len(errors)} planned cells; {summary}\n" + cross_table(result)


def cross_table(result: dict[str, Any]) -> str:
    """Each flavor's real peak ÷ the native engine's real peak on the same cell (empty without native)."""
    native = result.get("native", {})
    if not native:
        return ""
    ratios: dict[tuple[str, str], dict[str, float]] = {}
    for row in result["rows"]:
        base = native.get(row["model"], {}).get(row["cell"])
        if base:
            ratios.setdefault((row["model"], row["cell"]), {})[row["flavor"]] = row["real_bytes"] / base
    lines = ["", "| model | candidate | dtype | real native | DeepSpeed ÷ native | FSDP2 ÷ native |",
             "|---|---|---|---|---|---|"]
    for (model, cell), by in ratios.items():
        name, dtype = cell.split("/")
        shown = [f"{by[f]:.2f}x" if f in by else "-" for f in ("deepspeed", "fsdp2")]
        base = f"{native[model][cell] / 2**20:.1f} MiB"
        lines.append(f"| {model} | {name} | {dtype} | {base} | " + " | ".join(shown) + " |")
    spans = "; ".join(f"{f}: {min(v):.2f}x .. {max(v):.2f}x over {len(v)} cells"
                      for f in ("deepspeed", "fsdp2") if (v := [r[f] for r in ratios.values() if f in r]))
    return "\n".join(lines) + f"\n\nreal peak ÷ native's: {spans}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "qwen2"], help="names; qwen2 is QWEN2")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adamw", "adamw-fused", "sgd"), default="adamw",
                        help="the optimizer every run and plan steps (zerobridge plan --optimizer)")
    parser.add_argument("--flavors", nargs="+", choices=("deepspeed", "fsdp2"), default=["deepspeed", "fsdp2"])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                        help="the plan's candidate names (zero1, zero2+ac, ...)")
    parser.add_argument("--no-native", dest="native", action="store_false",
                        help="leave out the native engine's real runs (and the cross-flavor table)")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "bench" / "results" / "plan_flavors.json")
    parser.add_argument("--table", type=Path, metavar="JSON",
                        help="print the Markdown table of a results JSON (docs/plan.md's) and run nothing")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())), end="")
        return
    world = args.world_size
    os.environ.update(ENV)
    rows: list[dict[str, Any]] = []
    native: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        qwen2 = Path(folder, "qwen2.json")
        qwen2.write_text(json.dumps(QWEN2))
        for label in args.models:
            model = str(qwen2) if label == "qwen2" else label
            if args.native:
                native[label] = _native(model, world, tuple(args.candidates), args.optimizer)
                for key, peak in native[label].items():
                    print(f"{label:>10} {'native':>9} {key:14} real {peak / 2**20:7.1f} MiB", flush=True)
            params, largest = estimator_sizes(resolve_model(model).build())
            for flavor in args.flavors:
                specs = _specs(model, flavor, world, tuple(args.candidates))
                real = _real(model, flavor, specs, world, args.optimizer)
                planned = _planned(model, flavor, specs, world, args.optimizer)
                for key, spec in specs.items():
                    plan_bytes = planned[key]
                    error = None if plan_bytes is None else plan_bytes / real[key] - 1
                    # each flavor's own estimator: DeepSpeed's for its stages 2-3, Accelerate's for FSDP2
                    estimate = deepspeed_estimate(spec.sharding.stage.value, params=params, largest=largest,
                                                  world_size=world) if flavor == "deepspeed" else \
                        accelerate_estimate(params, key.split("/")[1])
                    rows.append({"model": label, "flavor": flavor, "cell": key, "real_bytes": real[key],
                                 "planned_bytes": plan_bytes, "error": error, "estimate_bytes": estimate,
                                 "estimate_error": None if estimate is None else estimate / real[key] - 1})
                    shown = "not modelled" if plan_bytes is None else f"{plan_bytes / 2**20:7.1f} MiB  {error:+.1%}"
                    print(f"{label:>10} {flavor:>9} {key:14} real {real[key] / 2**20:7.1f} MiB  plan {shown}",
                          flush=True)
    result = {"world_size": world, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "optimizer": args.optimizer,
              "rows": rows, "native": native}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), end="")


if __name__ == "__main__":
    main()
