"""A training run that saves every few steps and resumes from the newest checkpoint, and the faults
``tests/test_faults.py`` puts in its way: a rank killed mid-step or inside a save, a full disk.

As a script, under a launcher that restarts it (what ``zerobridge run --max-restarts`` checks)::

    zerobridge run --nproc 2 --max-restarts 3 -m zerobridge.testing.faults --root /tmp/ckpts --steps 10 \\
        --save-every 4 --kill step:6 --backend native --backend fsdp --backend deepspeed-api --out /tmp/final.pt

It runs each ``--backend`` in turn (under ``ROOT/BACKEND``): resumes from ``zerobridge.latest_checkpoint``
when there is a checkpoint, trains to ``--steps``, saving ``ROOT/BACKEND/step-N`` every ``--save-every``
steps. On attempt ``k`` (``TORCHELASTIC_RESTART_COUNT``) the ``k``-th backend's run dies as ``--kill``
says, so every backend is killed once and resumed by the launcher's restart; rank 0 writes each backend's
final full weights and the step it last resumed from to ``--out`` (``torch.save``).

    >>> from zerobridge.testing.faults import Kill
    >>> Kill.parse("save-manifest:8")
    Kill(where='save-manifest', step=8)

``run`` is the same loop as a function, which a ``harness.Cluster`` calls on every rank. Backends:
``native`` and ``fsdp`` (``zerobridge.prepare``, ZeRO-3) and ``deepspeed-api`` (``zerobridge.deepspeed``'s
engine on the native backend, ``engine.save_checkpoint`` / ``load_checkpoint`` with its ``latest`` file).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

import zerobridge
import zerobridge.deepspeed as deepspeed
from zerobridge.checkpoint import storage, writer
from zerobridge.checkpoint.storage import read_manifest, saving_dir, verify_files
from zerobridge.testing.parity import ParityNet, batch, make_optimizer

__all__ = ["BACKENDS", "KILLS", "Kill", "full_weights", "load_damaged", "main", "run", "run_disk_full"]

BACKENDS = ("native", "fsdp", "deepspeed-api")
KILLS = ("step", "save-write", "save-manifest", "save-swap")
"""Where a rank dies: mid-step (rank 1, after forward, before backward); inside a save: while the data
files are written (rank 1), after ``zerobridge.json`` is written and before the swap (rank 0, which
writes it), right after the swap put the new checkpoint in place, before the save returns (rank 0)."""
GLOBAL_BATCH = 8
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}}


@dataclass(frozen=True)
class Kill:
    """A rank SIGKILLs itself at ``where`` during step ``step`` (1-based: the save after step ``step``)."""

    where: str
    step: int

    @property
    def rank(self) -> int:
        """The rank that dies: rank 0 writes the manifest and swaps, so it dies there."""
        return 0 if self.where in ("save-manifest", "save-swap") else 1

    @classmethod
    def parse(cls, text: str) -> Kill:
        where, _, step = text.partition(":")
        if where not in KILLS or not step.isdigit():
            raise ValueError(f"expected WHERE:STEP with WHERE one of {', '.join(KILLS)}, got {text!r}")
        return cls(where, int(step))


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def _dying_save(where: str) -> Iterator[None]:
    """Patch the checkpoint writer so this process dies at ``where`` inside the next save."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if where == "save-write":
        resolve = writer._Planner.resolve_data
        calls = [0]

        def dying_resolve(self: Any, item: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:
                _die()
            return resolve(self, item)
        patch(writer._Planner, "resolve_data", dying_resolve)
    elif where == "save-manifest":
        def dying_swap(staged: Path, path: Path) -> None:
            _die()
        patch(writer, "swap_into_place", dying_swap)
    else:  # save-swap: the new checkpoint in place, the save not yet returned
        swap = storage.swap_into_place

        def swap_then_die(staged: Path, path: Path) -> None:
            swap(staged, path)
            _die()
        patch(writer, "swap_into_place", swap_then_die)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


class _Run:
    """One backend's model, step, save and load, behind one interface."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        model = ParityNet(0)
        if backend == "deepspeed-api":
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        config=DS_CONFIG)
            self.model = self.engine.module
        else:
            self.model, self.optimizer = zerobridge.prepare(model, make_optimizer(list(model.named_parameters()),
                                                                                  "adamw"),
                                                            stage=3, backend=backend)

    def step(self, step: int, die: Callable[[], None] | None) -> float:
        rank, world = dist.get_rank(), dist.get_world_size()
        per_rank = GLOBAL_BATCH // world
        tokens, targets = batch(step, 0, GLOBAL_BATCH)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        if self.backend == "deepspeed-api":
            loss = self.engine(tokens[mine], targets[mine])
            if die is not None:
                die()
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss = self.model(tokens[mine], targets[mine])
            if die is not None:
                die()
            loss.backward()
            zerobridge.clip_grad_norm_(self.model, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
        return float(loss.detach())

    def save(self, root: Path, step: int) -> None:
        if self.backend == "deepspeed-api":
            self.engine.save_checkpoint(root, tag=f"step-{step}", client_state={"step": step})
        else:
            zerobridge.save_checkpoint(root / f"step-{step}", self.model, self.optimizer, metadata={"step": step})

    def resume(self, root: Path) -> int:
        """Load the newest checkpoint under ``root``; the step it was saved after (0: none)."""
        if self.backend == "deepspeed-api":
            if not (root / "latest").is_file():
                return 0
            _, client_state = self.engine.load_checkpoint(root)
            return int((client_state or {})["step"])
        latest = zerobridge.latest_checkpoint(root)
        if latest is None:
            return 0
        return int(zerobridge.load_checkpoint(latest, self.model, self.optimizer)["step"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (collective)."""
    return {k: v.clone() for k, v in zerobridge.full_state_dict(model).items() if isinstance(v, torch.Tensor)}


def run(root: str, backend: str, steps: int, save_every: int, kill: str | None = None) -> dict[str, Any]:
    """Resume from ``root`` if it holds a checkpoint, train to ``steps`` saving every ``save_every``; die as
    ``kill`` says on its rank. Returns the step it resumed from, its losses and the final weights."""
    fault = Kill.parse(kill) if kill else None
    here = Path(root)
    job = _Run(backend)
    start = job.resume(here)
    losses = []
    mine = fault is not None and dist.get_rank() == fault.rank
    for step in range(start + 1, steps + 1):
        die = _die if mine and fault is not None and fault.where == "step" and fault.step == step else None
        losses.append(job.step(step - 1, die))
        if step % save_every == 0:
            if mine and fault is not None and fault.where != "step" and fault.step == step:
                with _dying_save(fault.where):
                    job.save(here, step)
            else:
                job.save(here, step)
    return {"resumed_from": start, "losses": losses, "weights": full_weights(job.model)}


@contextmanager
def _no_space(rank: int) -> Iterator[None]:
    """Rank ``rank``'s data files fail to write with ENOSPC (where no small file system can be mounted)."""
    write = filesystem._write_item

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if dist.get_rank() == rank:
        filesystem._write_item = full
    try:
        yield
    finally:
        filesystem._write_item = write


def _fill(root: Path, leave: int) -> Path:
    """A file that takes all but ``leave`` bytes of ``root``'s file system."""
    filler = root / "filler"
    stat = os.statvfs(root)
    with filler.open("wb") as fh:
        fh.truncate(0)
        chunk = b"\0" * (1 << 16)
        left = max(0, stat.f_bavail * stat.f_frsize - leave)
        while left > 0:
            fh.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
    return filler


def run_disk_full(root: str, backend: str, steps: int, save_every: int, fill: bool) -> dict[str, Any]:
    """Train, save after ``save_every`` steps, then find the disk full at the next save (``fill``: the file system
    at ``root`` filled up to half a checkpoint's room, else an injected ENOSPC on rank 1). Records what the
    failed save raised (caught as a plain ``Exception``), whether its staging directory is gone and the previous
    checkpoint still verifies; then frees the space, saves again and trains to ``steps``."""
    here = Path(root)
    job = _Run(backend)
    for step in range(1, save_every + 1):
        job.step(step - 1, None)
    job.save(here, save_every)
    first = here / f"step-{save_every}"
    size = sum(f.stat().st_size for f in first.iterdir())
    for step in range(save_every + 1, 2 * save_every + 1):
        job.step(step - 1, None)
    filler = _fill(here, size // 2) if fill and dist.get_rank() == 0 else None
    dist.barrier()
    error: dict[str, Any] | None = None
    try:
        with _no_space(rank=1) if not fill else nullcontext():
            job.save(here, 2 * save_every)
    except Exception as exc:  # what a script's ``except Exception`` around the save sees
        error = {"type": type(exc).__name__, "text": str(exc), "caught_as_exception": True}
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        error = {"type": type(exc).__name__, "text": str(exc)[:2000], "caught_as_exception": False}
    dist.barrier()
    staging_left = saving_dir(here / f"step-{2 * save_every}").exists()
    try:
        verify_files(first, read_manifest(first))
        previous_verifies = True
    except Exception:
        previous_verifies = False
    if filler is not None:
        filler.unlink()
    dist.barrier()
    job.save(here, 2 * save_every)  # room again: the same state saves
    for step in range(2 * save_every + 1, steps + 1):
        job.step(step - 1, None)
    return {"error": error, "staging_left": staging_left, "previous_verifies": previous_verifies,
            "weights": full_weights(job.model)}


def load_damaged(path: str, backend: str, verify: bool = True) -> dict[str, Any] | None:
    """Load checkpoint ``path`` into a fresh run on ``backend``; what it raised (``None``: it loaded)."""
    job = _Run(backend)
    try:
        zerobridge.load_checkpoint(path, job.model, job.optimizer, verify=verify)
    except Exception as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", required=True, help="where the checkpoints go (ROOT/BACKEND/step-N)")
    parser.add_argument("--backend", choices=BACKENDS, action="append", help="run each in turn (default: native)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--kill", help=f"WHERE:STEP, WHERE one of {', '.join(KILLS)}: the run of the k-th backend "
                                       "dies so on attempt k")
    parser.add_argument("--out", required=True, help="rank 0 writes {backend: {'attempt', 'resumed_from', "
                                                     "'weights'}} here (torch.save)")
    args = parser.parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    found = {}
    for index, backend in enumerate(args.backend or ["native"]):
        result = run(str(Path(args.root) / backend), backend, args.steps, args.save_every,
                     args.kill if attempt == index else None)
        found[backend] = {"attempt": attempt, "resumed_from": result["resumed_from"], "weights": result["weights"]}
    if dist.get_rank() == 0:
        torch.save(found, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
