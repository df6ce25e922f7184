"""``zerobridge checkpoint ...``: look inside a checkpoint, or turn it into one safetensors file.

    zerobridge checkpoint info ckpt/step-100                    # layout, tensors, optimizer, metadata; files verified
    zerobridge checkpoint info ckpt/step-100 --json
    zerobridge checkpoint consolidate ckpt/step-100 -o model.safetensors --dtype bf16
    zerobridge checkpoint import-deepspeed ds_ckpt/ ckpt/imported          # DeepSpeed ZeRO 1-3, optimizer state too
    zerobridge checkpoint import-deepspeed ds_ckpt/ -o ckpt/imported --tag global_step400
    zerobridge checkpoint export-deepspeed ckpt/step-100 ds_ckpt/ --stage 2 --world-size 8 --config ds.json

Exit codes: 0 success; 2 bad input (missing path, not a checkpoint, a file
that fails its check), with one message naming the file and the fix.

Each action is an ``Action`` in ``ACTIONS``; another command (e.g.
``import-deepspeed DIR -o PATH``) is one more entry: its ``add_arguments``
fills its parser and ``run`` returns the exit code. This module imports
torch only when an action runs, so the rest of the CLI stays fast.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerobridge.checkpoint.storage import MANIFEST, METADATA_FILE, CheckpointError, latest_checkpoint, leftovers

__all__ = ["ACTIONS", "Action", "add_parser", "run"]


@dataclass(frozen=True)
class Action:
    """One ``zerobridge checkpoint`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def describe(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, read from its metadata and small items only."""
    from zerobridge.checkpoint.matching import group_keys, state_keys  # lazy: loads torch
    from zerobridge.checkpoint.metadata import LAYOUT_KEY, read_run_state  # lazy: loads torch
    from zerobridge.checkpoint.reader import open_checkpoint  # lazy: loads torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unverified case is reported below instead
        ckpt = open_checkpoint(path)
    model = {k: md for k in ckpt if k.startswith("model.") and (md := ckpt.tensor(k)) is not None}
    dtypes: dict[str, int] = {}
    for md in model.values():
        name = str(md.properties.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
    states = state_keys(ckpt)
    groups = group_keys(ckpt)
    step_key = next((k for entries in states.values() for n, k in entries.items()
                     if n == "step" and ckpt.tensor(k) is not None), None)
    layout = ckpt.read_bytes([LAYOUT_KEY])[LAYOUT_KEY] if ckpt.is_bytes(LAYOUT_KEY) else None
    ranks = {k.split(".")[2] for k in ckpt if k.startswith("zerobridge.rng.")}
    files = ckpt.manifest["files"] if ckpt.manifest is not None else {}
    run = read_run_state(ckpt, with_scheduler=False, strict=False)
    info: dict[str, Any] = {
        "path": str(ckpt.path),
        "format": "zerobridge" if ckpt.manifest is not None else "torch.distributed.checkpoint (no manifest)",
        "verified": ckpt.manifest is not None,
        "files": len(files) if files else sum(1 for p in ckpt.path.iterdir() if p.is_file()),
        "bytes": sum(e["size"] for e in files.values()) if files else sum(
            p.stat().st_size for p in ckpt.path.iterdir() if p.is_file()),
        "saved_with": layout,
        "model_tensors": len(model),
        "model_elements": sum(md.size.numel() for md in model.values()),
        "dtypes": dtypes,
        "optimizer_groups": len(groups),
        "optimizer_state_params": len(states),
        "optimizer_keys": sorted({n for entries in states.values() for n in entries}),
        "optimizer_step": ckpt.full(step_key).item() if step_key is not None else None,
        "rng_ranks": len(ranks),
        "metadata": run.metadata,
        "scheduler": _position(run.scheduler),
        "client_state_keys": None if run.client_state is None else sorted(map(str, run.client_state)),
        "recovered": ckpt.recovered,
    }
    return info


def _position(state: dict[str, Any] | None) -> str | None:
    """Where a saved scheduler stands, in a few words (``None``: no scheduler state)."""
    if state is None:
        return None
    if "last_epoch" in state:
        return f"last_epoch {state['last_epoch']}, lr {state.get('_last_lr')}"
    if "last_batch_iteration" in state:
        return f"DeepSpeed schedule, last_batch_iteration {state['last_batch_iteration']}"
    return f"state with keys {sorted(map(str, state))}"


def _render(info: dict[str, Any]) -> str:
    layout = info["saved_with"]
    if layout:
        saved = (f"world {layout.get('world_size')}, shard group {layout.get('shard_size')}, "
                 f"{layout.get('replicas')} replica(s): {layout.get('strategy')}")
    else:
        saved = "unknown (not written by zerobridge)"
    step = info["optimizer_step"]
    lines = [
        f"checkpoint   {info['path']}",
        f"format       {info['format']}",
        f"files        {info['files']} files, {_human(info['bytes'])}; "
        + ("every file matches zerobridge.json (size, sha256)" if info["verified"] else "NOT verified: no manifest"),
        f"saved with   {saved}",
        f"model        {info['model_tensors']} tensors, {info['model_elements']:,} elements ("
        + ", ".join(f"{n} {d}" for d, n in sorted(info["dtypes"].items())) + ")",
        f"optimizer    {info['optimizer_groups']} param group(s); state for {info['optimizer_state_params']} "
        f"parameter(s): {', '.join(info['optimizer_keys']) or 'none'}"
        + (f"; step {step:g}" if step is not None else ""),
        f"rng          {info['rng_ranks']} rank(s)",
        f"metadata     {json.dumps(info['metadata'])}",
        f"scheduler    {info['scheduler'] or 'none saved'}",
        "client_state " + ("none saved" if info["client_state_keys"] is None
                           else f"keys {', '.join(info['client_state_keys']) or '(empty)'}"),
    ]
    if info["recovered"]:
        lines.append(f"recovered    {info['recovered']}")
    return "\n".join(lines) + "\n"


def _info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory, or a folder of them (lists them, the latest and leftovers)")
    p.add_argument("--json", action="store_true", help="JSON instead of text")


def describe_folder(path: str | Path) -> dict[str, Any] | None:
    """A folder of checkpoints (``ROOT/step-N``), not a checkpoint: the checkpoints in it, the one
    ``zerobridge.latest_checkpoint`` resumes from, and what interrupted saves left (``None``: not such a folder)."""
    root = Path(path)
    if not root.is_dir() or (root / MANIFEST).exists() or (root / METADATA_FILE).exists():
        return None
    checkpoints = sorted(e.name for e in root.iterdir()
                         if e.is_dir() and not e.name.startswith(".") and (e / MANIFEST).is_file())
    left = leftovers(root)
    if not checkpoints and not left:
        return None
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        latest = latest_checkpoint(root)
    return {"path": str(root), "checkpoints": checkpoints, "latest": None if latest is None else latest.name,
            "skipped": [str(w.message) for w in skipped],
            "leftovers": [{"name": e.name, "live": live} for e, live in left]}


def _render_folder(info: dict[str, Any]) -> str:
    lines = [f"folder       {info['path']}",
             f"checkpoints  {', '.join(info['checkpoints']) or 'none'}",
             f"latest       {info['latest'] or 'none complete and verified'} (zerobridge.latest_checkpoint)"]
    lines += [f"skipped      {line}" for line in info["skipped"]]
    for entry in info["leftovers"]:
        what = ("a save is writing it" if entry["live"] else
                "left by a save that never finished; the next save into this folder removes it")
        lines.append(f"leftover     {entry['name']}: {what}")
    return "\n".join(lines) + "\n"


def _info(args: argparse.Namespace) -> int:
    folder = describe_folder(args.path)
    if folder is not None:
        info, text = folder, _render_folder(folder)
    else:
        info = describe(args.path)
        text = _render(info)
    print(json.dumps(info, indent=2) if args.json else text, end="" if not args.json else "\n")
    return 0


def _consolidate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory (zerobridge or torch.distributed.checkpoint)")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .safetensors file to write (atomically)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cast floating tensors (default: as saved)")


def _consolidate(args: argparse.Namespace) -> int:
    from zerobridge.checkpoint.full import DTYPES, consolidate  # lazy: loads torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = consolidate(args.path, args.output, dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {args.output}: {len(names)} tensors")
    return 0


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="DeepSpeed checkpoint directory (holding 'latest') or one global_stepN/ directory")
    p.add_argument("destination", nargs="?", type=Path, metavar="OUTPUT",
                   help="the zerobridge checkpoint to write (atomically); or give it as -o")
    p.add_argument("-o", "--output", type=Path, help="the zerobridge checkpoint to write (atomically)")
    p.add_argument("--tag", help="the tag to read (default: the one 'latest' names, as DeepSpeed's load_checkpoint)")
    p.add_argument("--json", action="store_true", help="print the conversion report as JSON")


def _output(args: argparse.Namespace) -> Path:
    given = [p for p in (args.destination, args.output) if p is not None]
    if not given:
        raise CheckpointError("needs the checkpoint to write", source=args.directory, key="output",
                              fix=f"zerobridge checkpoint import-deepspeed {args.directory} OUTPUT")
    if len(given) == 2 and given[0] != given[1]:
        raise CheckpointError(f"got two outputs, {given[0]} and -o {given[1]}", key="output", fix="give one")
    output: Path = given[0]
    return output


def _import_deepspeed(args: argparse.Namespace) -> int:
    from zerobridge.checkpoint.deepspeed_import import import_deepspeed_checkpoint, run_extras  # lazy: loads torch
    from zerobridge.checkpoint.portable import write_portable  # lazy: loads torch

    output = _output(args)
    state, report = import_deepspeed_checkpoint(args.directory, args.tag)
    path = write_portable(output, state, extras=run_extras(state))
    if args.json:
        print(json.dumps({"output": str(path), "report": report.to_json()}, indent=2))
    else:
        meta = state.metadata
        print(f"read DeepSpeed ZeRO stage {meta.get('zero_stage')} checkpoint {meta.get('tag')} "
              f"(world size {meta.get('world_size')}): {len(state.model)} tensors, optimizer state for "
              f"{len(state.optimizer)} parameters"
              + (", LR scheduler state" if state.scheduler is not None else "")
              + (f", client_state {sorted(state.client_state)}" if state.client_state else ""))
        print(report.render())
        print(f"wrote {path}: load it with zerobridge.load_checkpoint at any stage and world size, or dcp.load (FSDP2)")
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="zerobridge checkpoint (any stage, world size, backend), or a save directory "
                   "whose 'latest' names one")
    p.add_argument("destination", type=Path, help="the DeepSpeed checkpoint directory to write (what "
                   "engine.load_checkpoint takes): the tag directory goes under it and 'latest' names it")
    p.add_argument("--stage", type=int, required=True, choices=(1, 2, 3), help="the DeepSpeed run's ZeRO stage")
    p.add_argument("--world-size", type=int, required=True, help="the DeepSpeed run's data-parallel world size")
    p.add_argument("--tag", help="the tag directory (default: global_step<global_steps>, as DeepSpeed names it)")
    p.add_argument("--config", type=Path, help="the DeepSpeed JSON the run uses (optimizer, scheduler, ZeRO "
                   "layout settings); without it: DeepSpeed's defaults and a torch Adam/AdamW client optimizer")
    p.add_argument("--frozen", action="append", default=[], metavar="NAME",
                   help="a frozen parameter the source's optimizer groups do not list (repeat); else taken for "
                        "a buffer")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _export_deepspeed(args: argparse.Namespace) -> int:
    from zerobridge.checkpoint.deepspeed_export import export_deepspeed_checkpoint  # lazy: loads torch

    path, report = export_deepspeed_checkpoint(args.source, args.destination, stage=args.stage,
                                               world_size=args.world_size, tag=args.tag, config=args.config,
                                               frozen=args.frozen)
    if args.json:
        print(json.dumps({"output": str(path), "report": report.to_json()}, indent=2))
    else:
        print(report.render())
        print(f"wrote {path}: a ZeRO-{args.stage} DeepSpeed run of {args.world_size} ranks resumes with "
              f"engine.load_checkpoint({str(args.destination)!r})")
    return 0


ACTIONS: dict[str, Action] = {
    "info": Action("what a checkpoint holds: layout, tensors, optimizer state, metadata; every file verified",
                   _info_arguments, _info),
    "consolidate": Action("the model's full weights as one safetensors file", _consolidate_arguments, _consolidate),
    "import-deepspeed": Action("a DeepSpeed ZeRO (stage 1-3) checkpoint as a zerobridge checkpoint, optimizer "
                               "state included", _import_arguments, _import_deepspeed),
    "export-deepspeed": Action("a zerobridge checkpoint as a DeepSpeed ZeRO (stage 1-3) checkpoint that "
                               "engine.load_checkpoint resumes from", _export_arguments, _export_deepspeed),
}


def add_parser(sub: Any) -> None:
    """Add ``checkpoint`` and its actions to the top-level subparsers."""
    c = sub.add_parser("checkpoint", help="inspect or convert a checkpoint")
    actions = c.add_subparsers(dest="checkpoint_action", required=True, metavar="ACTION")
    for name, action in ACTIONS.items():
        action.add_arguments(actions.add_parser(name, help=action.help))


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; file-system errors become clear ``CheckpointError``s (exit 2)."""

    try:
        return ACTIONS[args.checkpoint_action].run(args)
    except OSError as exc:
        raise CheckpointError(exc.strerror or str(exc), source=exc.filename or getattr(args, "path", None),
                              fix="check the path and permissions") from None
