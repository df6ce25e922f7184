"""A GPT of about 1B parameters at world 2, ZeRO-3, on this 2-core machine: peak
resident memory per rank while building, preparing and loading pretrained weights,
the eager way and the meta-device way, side by side in one run.

    python bench/big_model.py                       # 0.98B parameters: about 10 min on 2 cores, 24 GiB
    python bench/big_model.py --layers 4 --embd 512 --vocab 8192   # a quick look
    python bench/big_model.py --render              # rewrite the docs table from the saved JSON

The script first writes the model's weights (``TinyGPT`` from seed 1, tied
head saved once) to one safetensors file. Then each path runs in a fresh
2-process gloo group, one after the other, and every rank resets its
resident-set high-water mark once the group is up (glibc set to return
every large block on free, so RSS follows live tensors):

- ``eager``: build the model (its own init), copy every tensor from the file
  into it, ``zerobridge.prepare(stage=3)``: what users do today.
- ``meta``: build under ``device="meta"``, ``prepare(stage=3)`` (the
  construction replay, one module at a time), ``load_pretrained`` (each rank
  reads its own byte ranges).
- ``fsdp-meta``: the same on ``backend="fsdp"`` (torch FSDP2).

Against the floor ``4P/N + 4 x largest unit + process baseline``. Then one
SGD step and a second forward on every path: the losses must be equal, as the
weights are. Writes ``bench/results/big_model.json`` and the table between the
markers in ``docs/big-models.md`` (a test checks it matches the JSON). A
script, not a test: it never asserts times.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench/big_model.py: begin -->", "<!-- bench/big_model.py: end -->"
RESULTS = ROOT / "bench" / "results" / "big_model.json"
DOC = ROOT / "docs" / "big-models.md"
PATHS = ("eager", "meta", "fsdp-meta")


def write_weights(config: dict[str, int], target: Path) -> int:
    """The model's weights from seed 1 as one safetensors file; returns its size."""
    from safetensors.torch import save_file

    from zerobridge.models.tiny_gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(**config), seed=1)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte.weight
    save_file(state, str(target))
    del model, state
    gc.collect()
    return target.stat().st_size


def machine() -> str:
    """What the figures were measured on."""
    import platform

    import torch

    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()}-core {cpu}, {gib(memory)}, torch {torch.__version__}"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(results: dict[str, Any]) -> str:
    """The Markdown block ``docs/big-models.md`` carries between its markers."""
    lines = [f"`{results['command']}` on {results['machine']}, {results['date']}: "
             f"{results['params'] / 1e9:.2f}B parameters ({gib(results['file_bytes'])} of fp32 weights), "
             f"world 2, ZeRO-3. Per rank, the highest of the two ranks:", "",
             "| path | peak RSS | rise over baseline | floor | peak / floor | prepare + load | losses (step 0, 1) |",
             "|---|---|---|---|---|---|---|"]
    for path in PATHS:
        run = results["paths"].get(path)
        if run is None:
            lines.append(f"| {path} | — | — | — | — | — | not run |")
            continue
        if "error" in run:
            lines.append(f"| {path} | — | — | — | — | — | failed: {run['error']} |")
            continue
        losses = ", ".join(f"{x:.7f}" for x in run["losses"])
        lines.append(f"| {path} | {gib(run['peak'])} | {gib(run['rise'])} | {gib(run['floor'])} | "
                     f"{run['peak'] / run['floor']:.2f} | {run['seconds']:.0f} s | {losses} |")
    eager = results["paths"].get("eager", {}).get("losses")
    for path in PATHS[1:]:
        other = results["paths"].get(path, {}).get("losses")
        if eager and other:
            worst = max(abs(a - b) / abs(a) for a, b in zip(eager, other))
            lines.append(f"\n{path} vs eager: largest relative loss difference {worst:.1e}.")
    return "\n".join(lines) + "\n"


def command(argv: list[str]) -> str:
    """The command that reproduces the table: the arguments less ``--paths`` (runs of
    some paths merge into the saved figures of the same model)."""
    kept, skipping = [], False
    for arg in argv:
        if arg == "--paths":
            skipping = True
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        kept.append(arg)
    return " ".join(["python", "bench/big_model.py", *kept])


def splice(doc: str, block: str) -> str:
    """``doc`` with ``block`` between the markers."""
    head, found, rest = doc.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"{DOC}: the markers {BEGIN} and {END} are missing")
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--embd", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--render", action="store_true", help="only rewrite the docs table")
    args = parser.parse_args()
    if args.render:
        DOC.write_text(splice(DOC.read_text(), table(json.loads(RESULTS.read_text()))))
        return 0
    from zerobridge.harness.cluster import Cluster, RankError
    from zerobridge.models.tiny_gpt import GPTConfig, count_params

    config = {"vocab_size": args.vocab, "block_size": args.block, "n_layer": args.layers, "n_head": args.heads,
              "n_embd": args.embd}
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": command(sys.argv[1:]),
        "config": config, "params": count_params(GPTConfig(**config)), "paths": {}}
    if RESULTS.exists():  # paths not rerun keep their figures when the model is the same
        saved = json.loads(RESULTS.read_text())
        if saved.get("config") == config:
            results["paths"] = {k: v for k, v in saved["paths"].items() if k not in args.paths}
    with tempfile.TemporaryDirectory(prefix="zb-big-") as tmp:
        source = Path(tmp) / "model.safetensors"
        print(f"writing {results['params'] / 1e9:.2f}B parameters to {source}", file=sys.stderr, flush=True)
        results["file_bytes"] = write_weights(config, source)
        for path in args.paths:
            print(f"== {path}", file=sys.stderr, flush=True)
            try:
                with Cluster(2, timeout_s=3600) as cluster:
                    ranks = cluster.run("zerobridge.testing.big_model:big_model_run", path=path, source=str(source),
                                        config=config)
            except RankError as exc:
                results["paths"][path] = {"error": str(exc).splitlines()[0][:200]}
                continue
            worst = max(ranks, key=lambda r: r["peak"])  # type: ignore[index]
            results["paths"][path] = {**worst, "ranks": ranks}  # type: ignore[dict-item]
            print(f"   peak {gib(worst['peak'])}, floor {gib(worst['floor'])}, losses {worst['losses']}",
                  file=sys.stderr, flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = RESULTS.with_suffix(".tmp")
    tmp_file.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp_file, RESULTS)
    DOC.write_text(splice(DOC.read_text(), table(results)))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
