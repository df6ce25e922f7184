"""``zerobridge plan``: arguments, the table, ``--json`` and ``--to``.

    zerobridge plan llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --micro-batch 1 --seq-len 4096
    zerobridge plan ./my-model --world-size 8 --device-memory 24GiB --seq-len 2048 --to deepspeed -o ds.json
    zerobridge plan tiny-gpt:20m --world-size 2 --device-memory 1GiB --config ds.json --json

    zerobridge plan tiny-llama --world-size 2 --device-memory 1GiB --seq-len 128 --flavor all --to deepspeed

Exit 0 when a candidate fits (its config written with ``--to``), 1 when none
does (the message says what would), 2 on bad input. With ``--to`` and no
``-o``, the config goes to stdout and the table to stderr. ``--flavor all``
prints a peak column per flavor and a recommendation per flavor; the exit code
and ``--to`` follow the flavor ``--to`` runs on (native without ``--to``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zerobridge.checkpoint.storage import atomic_write_file
from zerobridge.errors import ConfigError
from zerobridge.translate.formats import TARGETS, write
from zerobridge.translate.formats import render as render_config
from zerobridge.translate.run_level import with_run_settings

if TYPE_CHECKING:
    from torch import nn

__all__ = ["add_parser", "run"]


def build_quietly(model: str) -> nn.Module:
    """The model ``model`` names, built with what its libraries log sent to stderr: a command whose
    stdout carries a table, JSON or a config (DeepSpeed, imported by transformers through accelerate,
    logs its accelerator to stdout). ``ConfigError`` as ``resolve_model`` raises it."""
    from zerobridge.planning.models import resolve_model  # lazy: it loads torch

    with contextlib.redirect_stdout(sys.stderr):
        return resolve_model(model).build()


def _positive(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the top-level parser's subcommands."""
    p = sub.add_parser(
        "plan", help="which strategy fits a model on N ranks, measured on fake tensors",
        description="Build MODEL on the meta device and train two steps of every candidate layout (ZeRO stages, "
                    "hybrid and hpZ layouts across nodes, offload, activation checkpointing, your own configs) on "
                    "fake tensors as one rank; print each one's device peak, host bytes and traffic per step, and "
                    "the one to run. Exit 0 when one fits, 1 when none does, 2 on bad input.")
    p.add_argument("model", metavar="MODEL",
                   help="tiny-gpt[:20m|:100m], llama-3-8b, llama-3-70b, llama-3-405b, mixtral-8x7b, tiny-llama, a "
                        "Hugging Face config.json or model directory (no weights read), or pkg.module:factory")
    p.add_argument("--world-size", type=_positive, required=True, help="data-parallel ranks")
    p.add_argument("--nodes", type=_positive, default=1, help="nodes the ranks are spread over (default 1)")
    p.add_argument("--device-memory", required=True, help="accelerator memory per rank, e.g. 80GiB or 80GB")
    p.add_argument("--host-memory", help="host memory per node, e.g. 1TiB (default: not checked)")
    p.add_argument("--micro-batch", type=_positive, default=1, help="samples per rank per forward (default 1)")
    p.add_argument("--seq-len", type=_positive, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--accumulation", type=_positive, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                   help="compute dtype; 16-bit keeps fp32 master weights (default bf16)")
    p.add_argument("--optimizer", choices=("adamw", "adamw-fused", "sgd"), default="adamw",
                   help="adamw: torch's AdamW one tensor at a time; adamw-fused: torch's fused AdamW, HF Trainer's "
                        "default (no step temporaries, as DeepSpeed's FusedAdam); sgd (default adamw)")
    p.add_argument("--config", "--strategy", dest="own", nargs="+", default=[], metavar="CONFIG",
                   help="your own config files or registry names, planned beside the candidates")
    p.add_argument("--only-own", action="store_true", help="plan only --config/--strategy (and their +ac forms)")
    p.add_argument("--whole", action="store_true",
                   help="measure every candidate at the model's full depth instead of extending two shallow "
                        "depths (models over 12 blocks; slower)")
    p.add_argument("--flavor", choices=("native", "fsdp2", "deepspeed", "all"),
                   help="the engine the peaks are for: zerobridge's native engine, the FSDP2 backend, DeepSpeed "
                        "(its buffers modelled), or all three, a peak column each, with one recommendation per "
                        "flavor (default: the flavor --to runs on, else native)")
    p.add_argument("--to", choices=sorted(TARGETS), help="write the recommended strategy in this format")
    p.add_argument("-o", "--output", type=Path, help="write the --to config here (atomically)")
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Plan, print, write; the exit code."""
    if args.output is not None and args.to is None:
        raise ConfigError("-o writes the --to config, and no --to is given", key="-o",
                          fix="add --to deepspeed (or another format), or drop -o")
    if args.json and args.to is not None and args.output is None:
        raise ConfigError("--json and --to both want stdout", key="--to", fix="add -o FILE for the config")
    from zerobridge.planning import planner, report  # lazy: torch, which registering the subcommand never needs
    from zerobridge.planning.flavors import flavor_for_target  # lazy: torch, as above

    runs_on = flavor_for_target(args.to) if args.to is not None else "native"
    flavor = args.flavor or runs_on
    if args.to is not None and flavor not in ("all", runs_on):
        print(f"zerobridge: warning: --to {args.to} runs on {runs_on}, and the peaks are "
              f"{flavor}'s (--flavor {flavor})", file=sys.stderr)

    plan, render, to_json, no_fit_message = planner.plan, report.render, report.to_json, report.no_fit_message
    # stdout carries the table, the JSON or the config: what the model's libraries log while it is built
    # (DeepSpeed, imported by transformers through accelerate, logs its accelerator to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        result = plan(args.model, world_size=args.world_size, nodes=args.nodes, device_memory=args.device_memory,
                      host_memory=args.host_memory, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      accumulation=args.accumulation, precision=args.precision, optimizer=args.optimizer,
                      strategies=args.own, only_own=args.only_own, whole=args.whole, flavor=flavor,
                      recommend_for=runs_on if flavor == "all" else None)
    table_out = sys.stderr if args.to is not None and args.output is None else sys.stdout
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(render(result), end="", file=table_out)
    best = result.recommended
    if not best.fits:
        print(f"zerobridge: {no_fit_message(result)}", file=sys.stderr)
        return 1
    if args.to is not None:
        spec, sizes = with_run_settings(best.spec, world_size=args.world_size).value, None
        if args.to == "deepspeed":  # buckets sized for the model, not DeepSpeed's 5e8 defaults
            from zerobridge.planning.candidates import deepspeed_form  # lazy: it loads torch

            spec, sizes = deepspeed_form(spec, build_quietly(args.model), own=best.own)
        written = write(spec, args.to, sizes=sizes)
        for entry in written.report.warnings:
            print(f"zerobridge: warning: {entry.key}: {entry.status.value}: {entry.note}", file=sys.stderr)
        text = render_config(written.value, args.to)
        if args.output is None:
            sys.stdout.write(text)
        else:
            atomic_write_file(args.output, lambda tmp: tmp.write_text(text, encoding="utf-8"))
            print(f"zerobridge: wrote {best.name} as {args.to} to {args.output}", file=sys.stderr)
    return 0
