"""``zerobridge compare``: arguments, progress lines and output files.

    zerobridge compare
    zerobridge compare --stages 0 3 --backends native deepspeed --steps 10 --json result.json
    zerobridge compare --config ds_config.json --markdown summary.md --plot compare.png

Everything is checked before the first process starts (exit 2 with the
argument and the fix). Then the exit code says what the runs did
(``EXIT_CODES``): 0 every run finished and agrees, 1 a finished run
disagrees with the reference, 3 a run failed (never started or crashed; its
first error line is printed) and the others agree. Output files are written atomically after the runs,
so a failed comparison never leaves half a file or clobbers an earlier one
with partial results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zerobridge.checkpoint.storage import atomic_write_file
from zerobridge.env import BACKENDS
from zerobridge.errors import ConfigError

if TYPE_CHECKING:  # registering the subcommand stays torch-free
    from zerobridge.compare.runner import RunOutcome

__all__ = ["EXIT_CODES", "add_parser", "run"]

EXIT_CODES = {"ok": 0, "disagree": 1, "failed": 3}
"""``zerobridge compare``'s exit code for a ``Comparison.status`` (2: bad input, before any run)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``compare`` on the top-level parser's subcommands."""
    c = sub.add_parser(
        "compare", help="train the same model on several stages and backends and check they agree",
        description="Train one model with the same seed and data on every requested ZeRO stage (or config) and "
                    "backend, each in a fresh process group, and compare losses, gradient norms, memory, "
                    "communication and step time. Exit 0 when all runs agree within the tolerance, 1 when one "
                    "diverges or fails, 2 on bad input.")
    c.add_argument("--stages", nargs="+", type=int, metavar="N", help="ZeRO stages (default 0 1 2 3 without --config)")
    c.add_argument("--config", nargs="+", default=[], metavar="FILE",
                   help="config files or strategy names to compare as well")
    c.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), metavar="NAME",
                   help=f"backends (default: {' '.join(BACKENDS)})")
    c.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    c.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    c.add_argument("--model", default="tiny-gpt",
                   help="tiny-gpt, tiny-gpt:20m, tiny-gpt:100m or pkg.module:factory returning a Workload")
    c.add_argument("--global-batch", type=int, help="rows per step for the built-in model (default 8)")
    c.add_argument("--seq-len", type=int, help="tokens per row for the built-in model (default 16)")
    c.add_argument("--tolerance", type=float, default=None,
                   help="relative tolerance on each step's loss for every run (default: 1e-5 in fp32; bf16/fp16 "
                        "runs: derived from a one-process rerun in their dtype)")
    c.add_argument("--norm-tolerance", type=float, default=None,
                   help="relative tolerance on each step's global grad norm for every run (default: 1e-4 in fp32; "
                        "bf16/fp16 runs: derived as for --tolerance)")
    c.add_argument("--clip", type=float, default=1.0, help="clip the global grad norm to this (0: no clipping)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--exact-only", action="store_true",
                   help="skip what a backend can only approximate (by default its closest form runs, marked ~)")
    c.add_argument("--compile", action="store_true",
                   help="run every pair under torch.compile (each spec's compile section: backend, mode, scope)")
    c.add_argument("--plan-memory", action="store_true",
                   help="also plan each run's peak with zerobridge plan (on the backend's flavor) and count the "
                        "run's own peak the same way: planned, measured and error per run (slower)")
    c.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    c.add_argument("--json", type=Path, metavar="FILE", help="write the JSON report here ('-': stdout)")
    c.add_argument("--markdown", type=Path, metavar="FILE", help="write a Markdown report (CI job summary)")
    c.add_argument("--plot", type=Path, metavar="FILE.png", help="draw loss curves, memory and communication")


def _writable(path: Path, flag: str) -> None:
    if str(path) == "-":
        return
    folder = path.parent if str(path.parent) else Path(".")
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if path.is_dir() or not probe.is_dir() or not os.access(probe, os.W_OK):
        raise ConfigError("cannot write here", source=str(path), key=flag,
                          fix="name a file in a writable directory")


def _write(path: Path, text: str) -> None:
    if str(path) == "-":
        sys.stdout.write(text)
        return
    atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _progress(index: int, total: int, outcome: RunOutcome) -> None:
    name = outcome.planned.name
    if outcome.error is not None:
        line = f"FAILED after {outcome.wall_s:.1f} s: {outcome.error}"
    else:
        line = (f"{len(outcome.losses)} steps in {outcome.wall_s:.1f} s, final loss {outcome.losses[-1]:.6f}, "
                f"median step {outcome.step_time_s * 1e3:.1f} ms")
    print(f"[{index + 1}/{total}] {name:<24} {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run ``zerobridge compare``; the exit code."""
    from zerobridge.compare.api import plan, run_plan  # lazy: loads torch; `zerobridge --help` does not

    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag) is not None:
            _writable(getattr(args, flag), f"--{flag}")
    if args.plot is not None:
        from zerobridge.compare.plot import require_matplotlib  # lazy: loads matplotlib, only for --plot

        require_matplotlib(args.plot)
    if args.clip < 0:
        raise ConfigError(f"--clip {args.clip}: must be positive, or 0 for no clipping", key="--clip")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}: must be positive", key="--timeout")
    planned = plan(stages=args.stages, configs=args.config, backends=args.backends, nproc=args.nproc,
                   steps=args.steps, model=args.model, global_batch=args.global_batch, seq_len=args.seq_len,
                   tolerance=args.tolerance, norm_tolerance=args.norm_tolerance, seed=args.seed,
                   exact_only=args.exact_only, compile=args.compile, plan_memory=args.plan_memory)
    for skipped in planned.comparison.skipped:
        print(f"skip {skipped.backend}/{skipped.label}: {skipped.reason}", file=sys.stderr)
    print(f"zerobridge compare: {len(planned.runs)} run(s) of {args.steps} steps on {args.nproc} process(es)",
          file=sys.stderr, flush=True)
    result = run_plan(planned, clip=args.clip or None, timeout_s=args.timeout, progress=_progress)
    if str(args.json) != "-":
        sys.stdout.write(result.render())
    if args.json is not None:
        _write(args.json, json.dumps(result.to_json(), indent=2) + "\n")
    if args.markdown is not None:
        _write(args.markdown, result.markdown())
    if args.plot is not None:
        from zerobridge.compare.plot import write_plot  # lazy: loads matplotlib, only for --plot

        write_plot(result, args.plot)
    return EXIT_CODES[result.status]
