"""The ``zerobridge`` command.

    zerobridge convert ds_config.json --to fsdp2            # fully_shard kwargs as JSON
    zerobridge convert accelerate_fsdp.yaml --to deepspeed   # a DeepSpeed JSON
    zerobridge convert zero3-offload --to accelerate-fsdp     # registry names work as input
    zerobridge convert ds_config.json --to fsdp1 --explain    # plus the key-by-key report (stderr)
    zerobridge convert ds_config.json --trainer-args          # Trainer flags keeping its optimizer, scheduler
    zerobridge convert train.sh --to trainer-deepspeed -o ds.json   # a Trainer launch script's run as DeepSpeed
    zerobridge convert ds_config.json --to trainer-fsdp -o fsdp.json  # fsdp_config to -o, its flags on stdout
    zerobridge convert llama3_8b.toml --to torchtitan         # a torchtitan job TOML
    zerobridge convert fsdp.yaml --to deepspeed --micro-batch 4 --clip 1.0   # concrete values for deepspeed.initialize
    zerobridge convert fsdp.yaml --to deepspeed --model config.json          # buckets sized for that model
    zerobridge explain ds_config.json --params 7e9 --world-size 64
    zerobridge diff a.json b.yaml                             # same run or not, and what differs
    zerobridge strategies                                     # the registry, one line each
    zerobridge run --nproc 4 --stage 3 train.py --lr 3e-4     # torchrun, strategy in $ZEROBRIDGE_CONFIG
    zerobridge checkpoint info ckpt/step-100                  # what a checkpoint holds; files verified
    zerobridge checkpoint consolidate ckpt/step-100 -o model.safetensors --dtype bf16
    zerobridge compare                                        # tiny GPT: stages 0-3 on native, FSDP2, DeepSpeed
    zerobridge compare --stages 3 --backends native fsdp --json result.json
    zerobridge plan llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --seq-len 4096   # what fits

Exit codes: 0 success; 1 ``--strict`` saw an approximation, ``diff`` found
a difference, ``compare`` saw runs disagree, or ``plan`` found nothing that fits;
2 bad input (the message names the file, key, line and fix); 3 ``compare``
had a run that failed (never started or crashed) while the others agree;
``run`` exits with the launcher's code.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shlex
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from zerobridge._version import __version__
from zerobridge.backends.deepspeed.extensions import build_ops
from zerobridge.checkpoint.cli import add_parser as add_checkpoint_parser
from zerobridge.checkpoint.cli import run as run_checkpoint
from zerobridge.checkpoint.storage import atomic_write_file
from zerobridge.compare.cli import add_parser as add_compare_parser
from zerobridge.compare.cli import run as run_compare
from zerobridge.demo import run_demo
from zerobridge.diff import diff_specs
from zerobridge.errors import ConfigError
from zerobridge.explain import explain
from zerobridge.launch import add_run_arguments, launch
from zerobridge.load import load_spec
from zerobridge.planning.cli import add_parser as add_plan_parser
from zerobridge.planning.cli import build_quietly
from zerobridge.planning.cli import run as run_plan
from zerobridge.registry import strategies
from zerobridge.spec import StrategySpec
from zerobridge.translate.deepspeed_buckets import BucketSizes
from zerobridge.translate.formats import SOURCES, TARGETS, render, write
from zerobridge.translate.keys import from_validation_error
from zerobridge.translate.report import Report
from zerobridge.translate.run_level import trainer_run_flags, with_run_settings
from zerobridge.translate.trainer_args import trainer_form_of
from zerobridge.translate.trainer_write import TrainerLaunch

__all__ = ["console", "main"]


def _number(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 7e9, got {text!r}") from None
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(value)


def _bound(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 1.0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a bound >= 0 (0: no clipping), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerobridge", description="One partitioning spec for DeepSpeed ZeRO and FSDP.")
    p.add_argument("--version", action="version", version=f"zerobridge {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="turn a config or strategy name into another format")
    c.add_argument("source", help="config file or strategy name")
    c.add_argument("--to", choices=sorted(TARGETS), help="target format (optional with --trainer-args/--trainer-code)")
    c.add_argument("--from", dest="fmt", choices=sorted(SOURCES), help="source format (detected when omitted)")
    c.add_argument("--explain", action="store_true", help="print the key-by-key report on stderr")
    c.add_argument("--strict", action="store_true", help="exit 1 when anything is approximated")
    c.add_argument("--world-size", type=_number, metavar="N",
                   help="ranks the config will run on: written where the target has a key for it (Accelerate "
                        "num_processes, DeepSpeed train_batch_size, FSDP meshes); hybrid groups must divide it; "
                        "a source written for another world size is overridden with a warning")
    c.add_argument("-o", "--output", type=Path, help="write here (atomically) instead of stdout")
    run = c.add_argument_group("run-level values", "state what the source leaves \"auto\" (plain "
                               "deepspeed.initialize cannot read \"auto\"); a stated value overrides the source's")
    run.add_argument("--micro-batch", type=_number, metavar="N", help="samples per rank per forward")
    run.add_argument("--accumulation", type=_number, metavar="N", help="micro-batches per optimizer step")
    run.add_argument("--clip", type=_bound, metavar="X", help="gradient 2-norm bound; 0: no clipping")
    run.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="compute dtype")
    run.add_argument("--model", metavar="MODEL",
                     help="--to deepspeed: size the buckets the source leaves to the engine (FSDP's one collective "
                          "per unit) to this model's largest wrap unit: a Hugging Face config.json or model "
                          "directory (built on the meta device, no weights read), or a name zerobridge plan takes")
    trainer = c.add_mutually_exclusive_group()
    trainer.add_argument("--trainer-args", action="store_true",
                         help="print, on one line, the Hugging Face TrainingArguments flags that keep the source's "
                              "optimizer, scheduler and stated run-level values (the config goes to -o)")
    trainer.add_argument("--trainer-code", action="store_true",
                         help="print torch code that builds the source's optimizer and scheduler in a plain loop")

    e = sub.add_parser("explain", help="what is sharded where; bytes per rank; bytes moved per step")
    e.add_argument("source", help="config file or strategy name")
    e.add_argument("--from", dest="fmt", choices=sorted(SOURCES))
    e.add_argument("--params", type=_number, required=True, help="parameter count, e.g. 7e9")
    e.add_argument("--world-size", type=_number, required=True, help="data-parallel ranks")
    e.add_argument("--local-world-size", type=_number, help="ranks per node (default: min(8, world))")
    e.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    e.add_argument("--json", action="store_true", help="JSON instead of text")

    d = sub.add_parser("diff", help="whether two configs mean the same run, and what differs")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true")

    s = sub.add_parser("strategies", help="the registry, one line each")
    s.add_argument("--json", action="store_true")

    sub.add_parser("demo", help="a strategy explained, converted to FSDP2 and read back (no training)")
    add_run_arguments(sub.add_parser(
        "run", allow_abbrev=False, help="launch a training script with torchrun and a chosen strategy",
        description="Run a training script under torch.distributed.run. Options before the script are "
                    "the launcher's; everything after it is passed to the script untouched."))
    add_checkpoint_parser(sub)
    add_compare_parser(sub)
    add_plan_parser(sub)
    o = sub.add_parser(
        "build-ops", help="compile DeepSpeed's C++ ops once, before a launch",
        description="Compile (or find compiled) the DeepSpeed ops a run here loads, into $TORCH_EXTENSIONS_DIR "
                    "(default ~/.cache/zerobridge/torch_extensions/torch-VERSION), so no rank compiles them "
                    "while the others wait. Exit 0 when every op loads, 1 when one cannot be built here.")
    o.add_argument("ops", nargs="*", metavar="OP",
                   help="shm_comm, fused_adam, cpu_adam, cpu_adagrad (default: every one this accelerator has)")
    o.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="ops compiled at once (default 1: each op's sources already compile in parallel)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return int(_COMMANDS[args.command](args))
    except ConfigError as exc:
        print(f"zerobridge: error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:  # a spec built from input no reader checked first
        print(f"zerobridge: error: {from_validation_error(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


def console() -> None:
    """The ``zerobridge`` console script: ``main``'s exit code, without the interpreter's teardown.

    After a command that imported torch and transformers (``plan``, ``compare``) the interpreter spends
    about a second freeing their modules one object at a time before the process ends (measured:
    0.4 s after ``import torch`` alone, 0.95 s with transformers' Qwen2 model imported; ``zerobridge plan``
    on a 6.5M config, every flavor: 0.94 s of 21 s). Nothing is lost by skipping it: the exit handlers
    run, both streams are flushed, and every file a command writes is closed when it returns (atomic
    writes). When a thread that is not a daemon is still running, the interpreter waits for it as usual."""
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left: nothing more to write
        pass
    os._exit(code)


def _warn(*reports: Report, source: str) -> None:
    """One stderr line per entry that changes the numbers or the memory; speed-only ones as one line."""
    for report in reports:
        for entry in report.warnings:
            note = entry.note.replace("zerobridge convert SOURCE", f"zerobridge convert {shlex.quote(source)}")
            changes = f" ({entry.impact.value})" if entry in report.approximations else ""
            print(f"zerobridge: warning: {entry.key}: {entry.status.value}{changes}: {note}", file=sys.stderr)
    speed = [e for r in reports for e in r.speed_only]
    if speed:
        knobs = "setting has" if len(speed) == 1 else "settings have"
        print(f"zerobridge: note: {len(speed)} {knobs} no form in the target and change only speed "
              f"({', '.join(e.key for e in speed[:3])}{', ...' if len(speed) > 3 else ''}); --explain lists them",
              file=sys.stderr)


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    atomic_write_file(output, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _convert(args: argparse.Namespace) -> int:
    if args.to is None and not (args.trainer_args or args.trainer_code):
        raise ConfigError("convert needs --to FORMAT, --trainer-args or --trainer-code",
                          fix=f"add --to one of {', '.join(sorted(TARGETS))}")
    read = load_spec(args.source, fmt=args.fmt)
    settings = with_run_settings(read.value, micro_batch=args.micro_batch, accumulation=args.accumulation,
                                 clip=args.clip, precision=args.precision, world_size=args.world_size)
    spec = settings.value
    reports = [read.report, settings.report]
    sizes = _model_sizes(args.model, spec, args.to) if args.model is not None else None
    written = write(spec, args.to, sizes=sizes) if args.to else None
    if written is not None:
        reports.append(written.report)
    if args.explain:
        for report in reports:
            if report.entries or report is not settings.report:
                print(report.render(), file=sys.stderr)
    _warn(*reports, source=str(args.source))
    if args.strict and any(r.approximations for r in reports):
        print("zerobridge: --strict: approximations above; nothing written", file=sys.stderr)
        return 1
    if written is not None:
        if args.output is None and (args.trainer_args or args.trainer_code):
            print(f"zerobridge: note: the {args.to} config is not printed beside the trainer output: pass -o FILE "
                  "to write it", file=sys.stderr)
        elif isinstance(written.value, TrainerLaunch):  # the config to -o (inline without), the flags to stdout
            if args.output is not None and written.value.config:
                _emit(render(written.value.config, "json"), args.output)
            path = str(args.output) if args.output is not None else None
            sys.stdout.write(render(written.value, args.to, path))
        else:
            _emit(render(written.value, args.to), args.output)
    if args.trainer_args:
        flags = (*trainer_run_flags(spec), *trainer_form_of(spec).flags)
        print(" ".join(shlex.quote(f) for f in flags))
    elif args.trainer_code:
        print(trainer_form_of(spec).code)
    return 0


def _model_sizes(model: str, spec: StrategySpec, target: str | None) -> BucketSizes | None:
    """DeepSpeed's buckets for ``--model``: ``ConfigError`` (exit 2) naming the file when it cannot be built."""
    if target != "deepspeed":
        raise ConfigError(f"--model {model} sizes DeepSpeed's buckets, and --to is {target}", key="--model",
                          fix="drop --model, or write --to deepspeed")
    from zerobridge.runtime.wrap_units import bucket_sizes  # lazy: it loads torch (other conversions never do)

    try:  # stdout carries the config
        built = build_quietly(model)
    except ConfigError as exc:
        raise ConfigError(exc.message, source=exc.source, key="--model", fix=exc.fix) from None
    except Exception as exc:  # a config transformers reads but cannot build a model from
        raise ConfigError(f"--model {model}: cannot build a model from it ({type(exc).__name__}: {exc})",
                          key="--model", fix="give the model's own config.json (or its directory)") from None
    return bucket_sizes(built, spec)


def _explain(args: argparse.Namespace) -> int:
    read = load_spec(args.source, fmt=args.fmt)
    result = explain(read.value, params=args.params, world_size=args.world_size,
                     local_world_size=args.local_world_size, optimizer=args.optimizer)
    _warn(read.report, source=str(args.source))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.render())
    return 0


def _diff(args: argparse.Namespace) -> int:
    a, b = load_spec(args.a), load_spec(args.b)
    result = diff_specs(a.value, b.value)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.render(str(args.a), str(args.b)))
    return 0 if result.same_run else 1


def _strategies(args: argparse.Namespace) -> int:
    entries = strategies()
    if args.json:
        print(json.dumps([{"name": s.name, "aliases": list(s.aliases), "title": s.title,
                           "summary": s.spec().value.summary()} for s in entries], indent=2))
        return 0
    width = max(len(s.name) for s in entries)
    for s in entries:
        aliases = f"  (also: {', '.join(s.aliases)})" if s.aliases else ""
        print(f"{s.name:<{width}}  {s.spec().value.summary()}{aliases}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    return run_demo()


def _run(args: argparse.Namespace) -> int:
    return launch(args)


def _compare(args: argparse.Namespace) -> int:
    return run_compare(args)


def _checkpoint(args: argparse.Namespace) -> int:
    return run_checkpoint(args)


def _plan(args: argparse.Namespace) -> int:
    return run_plan(args)


def _build_ops(args: argparse.Namespace) -> int:
    builds = build_ops(args.ops, jobs=args.jobs)
    width = max(len(b.name) for b in builds)
    for b in builds:
        done = (f"cannot be built here: {b.error}" if b.error else
                f"built in {b.seconds:.1f} s" if b.built else f"already built ({b.seconds:.1f} s to load)")
        print(f"{b.name:<{width}}  {done}")
    return 1 if any(b.error for b in builds) else 0


_COMMANDS = {"convert": _convert, "explain": _explain, "diff": _diff, "strategies": _strategies, "demo": _demo,
             "run": _run, "checkpoint": _checkpoint, "compare": _compare, "plan": _plan,
             "build-ops": _build_ops}

if __name__ == "__main__":
    console()
