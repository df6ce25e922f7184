"""A launch script or flags file -> the ``TrainingArguments`` flags its training command passes.

    >>> from zerobridge.translate.launch_script import parse_launch_script
    >>> text = '''#!/bin/bash
    ... export WANDB_MODE=offline
    ... torchrun --nproc_per_node=8 train.py \\\\
    ...     --bf16 True --fsdp "full_shard auto_wrap" \\\\
    ...     --data_path $DATA --fp16
    ... '''
    >>> located = parse_launch_script(text, "run.sh")
    >>> located.data
    {'bf16': 'True', 'fsdp': 'full_shard auto_wrap', 'data_path': '$DATA', 'fp16': True}
    >>> located.lines["fsdp"], located.command.launcher, located.command.world_size
    (4, 'torchrun', 8)

The training command is the first line (after ``\\`` continuations are joined)
that runs ``torchrun``, ``deepspeed``, ``accelerate launch``, ``python -m
torch.distributed.run``/``launch`` or ``python script.py``, after any
``NAME=value`` prefixes. The launcher's own options are kept apart from the
script's flags; quoting is undone as the shell does, and ``$VARS`` and ``~``
are kept as written (nothing is expanded); the arguments end at a pipe or
redirection (``2>&1 | tee log``), and the script's positional arguments and
array expansions (``"${EXTRA[@]}"``) are skipped. A flag with no value (``--fp16``)
reads as ``True``; ``--a-b`` is ``--a_b``, as ``HfArgumentParser`` accepts
both. A flags file is the same without a launcher: flags only, any number of
lines.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.translate.sources import Located

__all__ = ["LaunchCommand", "ScriptLocated", "parse_flags_file", "parse_launch_script"]

_PYTHONS = ("python", "python3")
_LAUNCH_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_SWITCHES = frozenset({
    "standalone", "no_python", "run_path", "use_env", "module", "m",  # torchrun
    "no_local_rank", "force_multi", "bind_cores_to_rank", "no_ssh_check", "save_pid", "enable_each_rank_log",
    "multi_gpu", "use_fsdp", "use_deepspeed", "cpu", "debug", "quiet", "tpu", "same_network",  # accelerate
})
"""Launcher options that take no value."""
_PROCESSES = {"nproc_per_node": "nproc_per_node", "num_gpus": "nproc_per_node", "num_processes": "world",
              "nnodes": "nnodes", "num_nodes": "nnodes", "num_machines": "nnodes"}


@dataclass(frozen=True)
class LaunchCommand:
    """The training command a script runs."""

    launcher: str
    """``torchrun``, ``deepspeed``, ``accelerate launch`` or ``python``."""
    script: str
    """The training script or ``-m`` module."""
    options: dict[str, str | bool] = field(default_factory=dict)
    """The launcher's own options (underscored names), as written."""
    line: int = 1
    """Where the command starts (1-based)."""

    @property
    def world_size(self) -> int | None:
        """Processes the launcher starts, when its options say so with numbers."""
        found: dict[str, int] = {}
        for name, value in self.options.items():
            kind = _PROCESSES.get(name)
            if kind and isinstance(value, str) and value.isdigit():
                found[kind] = int(value)
        if "world" in found:
            return found["world"]
        if "nproc_per_node" in found:
            return found["nproc_per_node"] * found.get("nnodes", 1)
        return None


@dataclass
class ScriptLocated(Located):
    """Flags read from a script or flags file: ``data`` maps flag names (no dashes) to values."""

    command: LaunchCommand | None = None
    """The training command, for a launch script; None for a flags file."""


def _logical_lines(text: str) -> list[tuple[int, list[tuple[int, str]]]]:
    """Commands with ``\\`` continuations joined: (first line, [(line, token), ...])."""
    commands: list[tuple[int, list[tuple[int, str]]]] = []
    pending: list[tuple[int, str]] = []
    start, carry, carry_line = 0, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = carry + raw if carry else raw
        first = carry_line or number
        continued = line.rstrip().endswith("\\")
        body = line.rstrip()[:-1] if continued else line
        try:
            words = shlex.split(body, comments=True)
        except ValueError:  # a quote left open: the next line continues it
            carry, carry_line = body + "\n", first
            continue
        carry, carry_line = "", 0
        if not pending:
            start = first
        pending += [(first, word) for word in words]
        if not continued:
            if pending:
                commands.append((start, pending))
            pending = []
    if pending:
        commands.append((start, pending))
    return commands


def _is_assignment(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and name.replace("_", "a").isalnum() and not name[0].isdigit()


def _name(word: str) -> str:
    return word.lstrip("-").replace("-", "_")


def _launcher(words: list[str]) -> tuple[str, int] | None:
    """The launcher and where its options start, or None when the words run no training."""
    head = words[0].rsplit("/", 1)[-1]
    if head == "torchrun" or head == "deepspeed":
        return head, 1
    if head == "accelerate" and len(words) > 1 and words[1] == "launch":
        return "accelerate launch", 2
    if head in _PYTHONS or head.startswith("python3."):
        if len(words) > 2 and words[1] == "-m" and words[2] in _LAUNCH_MODULES:
            return "torchrun", 3
        if len(words) > 2 and words[1] == "-m":
            return "python", 1
        if len(words) > 1 and words[1].endswith(".py"):
            return "python", 1
    return None


def _split_launcher(tokens: list[tuple[int, str]], first: int) -> tuple[dict[str, str | bool], str, int]:
    """The launcher's options, the script, and the index of the script's first flag."""
    options: dict[str, str | bool] = {}
    i = first
    while i < len(tokens):
        word = tokens[i][1]
        if word == "-m" and i + 1 < len(tokens):
            return options, tokens[i + 1][1], i + 2
        if word.startswith("$") and not word.endswith(".py") and i + 1 < len(tokens) \
                and not tokens[i + 1][1].startswith("-"):  # launcher options in a variable ("${ARGS[@]}")
            i += 1
            continue
        if not word.startswith("-"):
            return options, word, i + 1
        name, eq, value = word.partition("=")
        key = _name(name)
        if eq:
            options[key] = value
        elif key in _SWITCHES or i + 1 >= len(tokens) or tokens[i + 1][1].startswith("-"):
            options[key] = True
        else:
            options[key] = tokens[i + 1][1]
            i += 1
        i += 1
    return options, "", len(tokens)


def _is_flag(word: str) -> bool:
    if not word.startswith("--") or len(word) == 2:
        return False
    return not word[2:3].isdigit()


def _is_operator(word: str) -> bool:
    """A pipe, list operator or redirection: the command's arguments end here (``2>&1 | tee log``)."""
    return word in ("|", "||", "&&", ";", "&") or word.lstrip("0123456789&").startswith((">", "<"))


def _flags(tokens: list[tuple[int, str]], source: str, *, script: bool = True) -> tuple[dict[str, Any],
                                                                                        dict[str, int]]:
    """``--name value`` pairs; ``script``: the script's own positional arguments and unseen expansions
    (``"${EXTRA[@]}"``) are skipped, where a flags file refuses anything but flags."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    last: str | None = None
    for number, word in tokens:
        if _is_operator(word):
            break
        if script and (last is None or word.startswith("$") and data[last] is not True) and not _is_flag(word):
            continue
        if _is_flag(word):
            name, eq, value = word[2:].partition("=")
            last = name.replace("-", "_")
            if last in data:
                raise ConfigError(f"--{last} is given twice (lines {lines[last]} and {number})", source=source,
                                  line=number, key=f"--{last}",
                                  fix="keep one: argparse would silently take the last")
            data[last], lines[last] = (value if eq else True), number
        elif last is not None and data[last] is True:
            data[last] = word
        elif last is not None:  # an unquoted value with spaces: the shell splits it, argparse would refuse it
            data[last] = f"{data[last]} {word}"
        else:
            raise ConfigError(f"{word!r} comes before any --flag", source=source, line=number,
                              fix="a flags file holds only --name value pairs")
    return data, lines


def parse_launch_script(text: str, source: str) -> ScriptLocated:
    """The training command's flags, each with its line; ``ConfigError`` naming the file when no line
    runs training."""
    for start, tokens in _logical_lines(text):
        words = [w for _, w in tokens]
        skip = 0
        while skip < len(words) and _is_assignment(words[skip]):
            skip += 1
        if skip < len(words) and words[skip] in ("env", "exec", "nohup", "time"):
            skip += 1
            while skip < len(words) and _is_assignment(words[skip]):
                skip += 1
        if skip >= len(words):
            continue
        found = _launcher(words[skip:])
        if found is None:
            continue
        launcher, first = found
        options, script, at = _split_launcher(tokens, skip + first)
        data, lines = _flags(tokens[at:], source)
        command = LaunchCommand(launcher, script, options, tokens[0][0] if tokens else start)
        return ScriptLocated(data=data, source=source, text=text, lines=lines, command=command)
    first_line = next((n for n, raw in enumerate(text.splitlines(), 1)
                       if raw.strip() and not raw.lstrip().startswith("#")), 1)
    raise ConfigError("no training command: no line runs torchrun, deepspeed, accelerate launch or python "
                      "with a script", source=source, line=first_line,
                      fix="give the script whose command line holds the TrainingArguments flags, "
                          "or a flags file (--name value ...)")


def parse_flags_file(text: str, source: str) -> ScriptLocated:
    """A file of ``--name value`` flags (any lines, ``#`` comments)."""
    tokens = [token for _, command in _logical_lines(text) for token in command]
    if not tokens:
        raise ConfigError("no flags in the file", source=source, line=1,
                          fix="write the TrainingArguments flags, e.g. --fsdp --fsdp_config fsdp.json")
    data, lines = _flags(tokens, source, script=False)
    return ScriptLocated(data=data, source=source, text=text, lines=lines)
