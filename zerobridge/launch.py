"""``zerobridge run``: start a training script under ``torch.distributed.run``.

On the command line::

    zerobridge run --nproc 4 --stage 3 train.py --lr 3e-4
    zerobridge run --standalone --nproc 2 --config ds_config.json -m mypkg.train
    zerobridge run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --strategy zero3-offload train.py

    >>> from zerobridge.launch import add_run_arguments, launch_env
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="zerobridge run")
    >>> add_run_arguments(parser)
    >>> args = parser.parse_args(["--stage", "3", "--backend", "fsdp", "train.py", "--lr", "3e-4"])
    >>> args.script, args.script_args
    ('train.py', ['--lr', '3e-4'])
    >>> env = launch_env(args, base={})
    >>> env["ZEROBRIDGE_CONFIG"], env["ZEROBRIDGE_BACKEND"]
    ('stage:3', 'fsdp')

Flags before the script belong to the launcher and become ``torchrun`` flags
(only those given are passed); the script and everything after it are passed
through untouched. The strategy the user chose reaches every worker in
``ZEROBRIDGE_CONFIG`` (its grammar: ``zerobridge.env``), the backend in
``ZEROBRIDGE_BACKEND``, ``--allow-approximate`` in
``ZEROBRIDGE_ALLOW_APPROXIMATE=1``, ``--compile`` in ``ZEROBRIDGE_COMPILE=1``.
``--max-restarts N`` restarts every worker after one dies, up to N times, each
attempt with a fresh rendezvous store ([Note: restarts]); the script finds
where to resume with ``zerobridge.latest_checkpoint``.
The strategy and backend are checked before anything is started
(``backends/preflight.py``): a config that does not load, or a spec the
backend cannot run, is a ``ConfigError`` (exit 2).

The workers also get ``ZEROBRIDGE_PREPARED``, a file in a directory of the
launcher's that ``zerobridge.prepare`` creates when it is called. A script
that exits 0 without any of this node's workers having called it used none
of what the launcher passed: the launcher says so on stderr, naming the flags
and the fix, and still exits with the script's code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from zerobridge import env as zenv
from zerobridge.backends.preflight import preflight
from zerobridge.env import BACKENDS, encode_choice
from zerobridge.errors import ConfigError
from zerobridge.load import load_spec, load_spec_for_world
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import STAGES, spec_for_stage

__all__ = ["add_run_arguments", "launch", "launch_env", "restarts", "torchrun_command", "validate"]

# (argparse dest, torchrun flag) for every launcher option that takes a value.
_VALUE_FLAGS: tuple[tuple[str, str], ...] = (
    ("nnodes", "--nnodes"),
    ("nproc", "--nproc-per-node"),
    ("node_rank", "--node-rank"),
    ("master_addr", "--master-addr"),
    ("master_port", "--master-port"),
    ("rdzv_backend", "--rdzv-backend"),
    ("rdzv_endpoint", "--rdzv-endpoint"),
    ("rdzv_id", "--rdzv-id"),
    ("max_restarts", "--max-restarts"),
)


def _nproc(text: str) -> str:
    if text in ("auto", "cpu", "gpu", "xpu") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"expected a positive integer or auto/cpu/gpu/xpu, got {text!r}")


def _nnodes(text: str) -> str:
    parts = text.split(":")
    if 1 <= len(parts) <= 2 and all(p.isdigit() and int(p) > 0 for p in parts):
        return text
    raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (positive integers), got {text!r}")


def _non_negative(text: str) -> int:
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")


def _port(text: str) -> int:
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {text!r}")


class _ScriptAction(argparse.Action):
    """Splits the command line after the launcher options into ``script`` and ``script_args``.

    One REMAINDER positional takes everything, ``--`` included: a plain
    positional for the script would swallow a ``--`` that follows it.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        words = [values] if isinstance(values, str) else list(values or [])
        if words[:1] == ["--"]:  # `zerobridge run --nproc 2 -- train.py ...`
            words = words[1:]
        if not words:
            parser.error("the following arguments are required: script")
        namespace.script, namespace.script_args = words[0], words[1:]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zerobridge run`` options, positionals last so script flags stay the script's."""
    parser.usage = ("%(prog)s [launcher options] [--config FILE | --stage {0,1,2,3} | --strategy NAME]\n"
                    "       [--backend {native,fsdp,deepspeed}] [--allow-approximate] [--compile] [-m] "
                    "script [args ...]")
    g = parser.add_argument_group("processes (passed to torchrun when given)")
    g.add_argument("--nproc", type=_nproc, metavar="N", help="workers per node (torchrun --nproc-per-node)")
    g.add_argument("--nnodes", type=_nnodes, metavar="N", help="nodes, or MIN:MAX for elastic jobs")
    g.add_argument("--node-rank", type=_non_negative, metavar="R", help="this node's rank")
    g.add_argument("--master-addr", metavar="A", help="address of the rank-0 node")
    g.add_argument("--master-port", type=_port, metavar="P", help="port of the rank-0 node")
    g.add_argument("--rdzv-backend", metavar="B", help="rendezvous backend, e.g. c10d")
    g.add_argument("--rdzv-endpoint", metavar="E", help="rendezvous endpoint host:port")
    g.add_argument("--rdzv-id", metavar="I", help="job id shared by all nodes")
    g.add_argument("--max-restarts", type=_non_negative, metavar="K", help="restarts before giving up")
    g.add_argument("--standalone", action="store_true", help="single node; local rendezvous on a free port")
    s = parser.add_argument_group("strategy (exported to workers as $ZEROBRIDGE_CONFIG)")
    choice = s.add_mutually_exclusive_group()
    choice.add_argument("--config", metavar="FILE", help="a config file: DeepSpeed JSON, Accelerate YAML, ...")
    choice.add_argument("--stage", type=int, choices=STAGES, help="a ZeRO stage")
    choice.add_argument("--strategy", metavar="NAME", help="a registry name (`zerobridge strategies`)")
    s.add_argument("--backend", choices=BACKENDS, help="exported to workers as $ZEROBRIDGE_BACKEND")
    s.add_argument("--allow-approximate", action="store_true",
                   help="let the backend run its closest form of what it cannot express (warned, recorded); "
                        "exported as $ZEROBRIDGE_ALLOW_APPROXIMATE=1")
    s.add_argument("--compile", action="store_true",
                   help="run the model's units under torch.compile (the spec's compile section gives backend, "
                        "mode and scope); exported as $ZEROBRIDGE_COMPILE=1")
    parser.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("script", nargs=argparse.REMAINDER, action=_ScriptAction, metavar="script [args ...]",
                        help="training script (or module with -m), then its arguments, passed untouched")


def _world(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(world size, ranks per node) when the launcher flags fix them, else None for what they leave open."""
    nproc = int(args.nproc) if str(args.nproc or "").isdigit() else None
    nnodes = int(args.nnodes or "1") if str(args.nnodes or "1").isdigit() else None
    return (nproc * nnodes if nproc is not None and nnodes is not None else None), nproc


def validate(args: argparse.Namespace) -> None:
    """Raise ``ConfigError`` when the launch would fail: before any process starts."""
    encode_choice(config=args.config, stage=args.stage, strategy=args.strategy)
    if args.backend is not None and args.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {args.backend!r}", key="--backend", fix=f"one of {', '.join(BACKENDS)}")
    spec = None
    if args.config is not None:
        path = Path(args.config).expanduser()
        if not path.is_file():
            raise ConfigError("config file not found", source=args.config, key="--config",
                              fix="check the path; for a registry name use --strategy")
        spec = load_spec_for_world(path, _world(args)[0], flag="--nproc")   # the world size: once, before launch
    elif args.strategy is not None:
        spec = load_spec(args.strategy).value
    elif args.stage is not None and args.backend in ("fsdp", "deepspeed"):
        spec = spec_for_stage(int(args.stage))  # FSDP2 and DeepSpeed cannot run every stage: check it too
    if spec is not None and getattr(args, "compile", False):
        spec = spec.model_copy(update={"compile": spec.compile.model_copy(update={"enabled": True})})
    if spec is not None:
        _preflight(args, spec)
    if not args.module and not Path(args.script).is_file():
        raise ConfigError("training script not found", source=args.script,
                          fix="check the path; use -m to run a module by name")


def _preflight(args: argparse.Namespace, spec: StrategySpec) -> None:
    """Refuse before launching what the chosen backend cannot run (exactly, unless
    ``--allow-approximate``); checks that need the world size are skipped when the launcher
    cannot tell it."""
    world, nproc = _world(args)
    backend = args.backend or "native"
    allow = bool(getattr(args, "allow_approximate", False))
    try:
        found = preflight(backend, spec, world_size=world, local_world_size=nproc, allow_approximate=allow)
    except ConfigError as exc:
        source = args.config or args.strategy or (f"--stage {args.stage}" if args.stage is not None else None)
        approximate = "allow_approximate" in (exc.fix or "")
        fix = ("use --backend native, change the spec, or add --allow-approximate to run the backend's closest "
               "form") if approximate else exc.fix
        raise ConfigError(exc.message, source=source, key=exc.key, fix=fix) from None
    for entry in found:
        print(f"zerobridge: warning: --allow-approximate: {backend} runs {entry.key} approximately: {entry.note}",
              file=sys.stderr)


def restarts(args: argparse.Namespace) -> bool:
    """Whether the launch may restart its workers (``--max-restarts`` above 0)."""
    return bool(getattr(args, "max_restarts", None))


def _restart_rendezvous(args: argparse.Namespace) -> list[str]:
    """[Note: restarts] torchrun's default (static) rendezvous keeps one store for every attempt: a restarted
    worker reads the dead attempt's addresses under the same keys (its default group, every ``new_group``
    FSDP2, DeepSpeed and the engine create) and fails with "Gloo connectFullMesh failed ... Connection
    refused". A launch that may restart therefore uses the c10d rendezvous, and ``launch_env`` sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so each attempt gets a fresh store on a fresh port. One node:
    ``localhost:0`` (a free port); several: ``--master-addr:--master-port`` (default 29500) on every node, as
    the static rendezvous would have used. An explicit ``--rdzv-backend`` or ``--standalone`` is kept."""
    if not restarts(args) or getattr(args, "rdzv_backend", None) or getattr(args, "standalone", False):
        return []
    nodes = str(getattr(args, "nnodes", None) or "1")
    if nodes == "1":
        endpoint = f"localhost:{args.master_port or 0}"
    else:
        endpoint = f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29500}"
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", getattr(args, "rdzv_endpoint", None) or endpoint]


def torchrun_command(args: argparse.Namespace, *, python: str | None = None) -> list[str]:
    """The launcher command for parsed ``zerobridge run`` arguments (pure: starts nothing). With
    ``--max-restarts`` the rendezvous is c10d (see [Note: restarts])."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    rendezvous = _restart_rendezvous(args)
    replaced = {"master_addr", "master_port", "rdzv_endpoint"} if rendezvous else set()
    for dest, flag in _VALUE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None and dest not in replaced:
            cmd += [flag, str(value)]
    cmd += rendezvous
    if getattr(args, "standalone", False):
        cmd.append("--standalone")
    if getattr(args, "module", False):
        cmd.append("--module")
    return [*cmd, args.script, *getattr(args, "script_args", [])]


def launch_env(args: argparse.Namespace, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: ``base`` (default ``os.environ``) plus the zerobridge variables.

    A variable the user did not choose on the command line is inherited as is.
    """
    env = dict(os.environ if base is None else base)
    choice = encode_choice(config=args.config, stage=args.stage, strategy=args.strategy)
    if choice is not None:
        env[zenv.CONFIG] = choice
    if args.backend is not None:
        env[zenv.BACKEND] = args.backend
    if getattr(args, "allow_approximate", False):
        env[zenv.ALLOW_APPROXIMATE] = "1"
    if getattr(args, "compile", False):
        env[zenv.COMPILE] = "1"
    if restarts(args):  # a fresh rendezvous store per attempt: [Note: restarts]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _warn_ignored(args: argparse.Namespace) -> None:
    if args.standalone:
        ignored = [flag for dest, flag in _VALUE_FLAGS if dest.startswith("rdzv") and getattr(args, dest)]
        if ignored:
            print(f"zerobridge: warning: --standalone picks its own rendezvous; {', '.join(ignored)} ignored",
                  file=sys.stderr)


def _chosen_flags(args: argparse.Namespace) -> list[str]:
    """The zerobridge choices given on the command line, as typed (what only ``prepare`` reads)."""
    flags = [f"{flag} {value}" for flag, value in (("--config", args.config), ("--stage", args.stage),
                                                   ("--strategy", args.strategy), ("--backend", args.backend))
             if value is not None]
    return flags + [flag for flag, dest in (("--allow-approximate", "allow_approximate"), ("--compile", "compile"))
                    if getattr(args, dest, False)]


def _warn_unprepared(args: argparse.Namespace) -> None:
    flags = _chosen_flags(args)
    if flags:
        print(f"zerobridge: warning: {args.script} exited without calling zerobridge.prepare on this node, so "
              f"{' '.join(flags)} had no effect\n  fix: prepare the model in the script "
              "(model, optimizer = zerobridge.prepare(model, optimizer)), which reads them from the environment; "
              "or launch a script that does not use zerobridge with torchrun", file=sys.stderr)


def launch(args: argparse.Namespace) -> int:
    """Validate, start torchrun, wait; returns its exit code (128+N when killed by signal N).
    Warns when the script succeeded without ever calling ``zerobridge.prepare``."""
    validate(args)
    _warn_ignored(args)
    with tempfile.TemporaryDirectory(prefix="zerobridge-run-") as scratch:
        marker = Path(scratch) / "prepared"
        code = _run(args, {**launch_env(args), zenv.PREPARED: str(marker)})
        if code == 0 and not marker.exists():
            _warn_unprepared(args)
    return code


def _run(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Start torchrun with ``env``, forward SIGTERM and SIGHUP, wait; its exit code."""
    proc = subprocess.Popen(torchrun_command(args), env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: leave signal handling alone
            break
    interrupts = 0
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                # Ctrl-C reached torchrun too (same process group) and it is
                # stopping its workers; insist only on repeated interrupts.
                interrupts += 1
                if interrupts == 2:
                    proc.terminate()
                elif interrupts > 2:
                    proc.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
