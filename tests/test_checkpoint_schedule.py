"""Checkpoints carry the run: the LR scheduler's position and the client state, on every backend.

ParityNet trains ``SAVED_AT`` steps under a warmup-then-decay ``LambdaLR``
(world 2) on one backend and saves with ``scheduler=`` and ``client_state=``;
a fresh model, optimizer (other hyperparameters) and scheduler on another
backend, stage or world size load it and train on. Every lr and loss after
the resume must equal the uninterrupted single-process run's (lrs exactly,
losses within 1e-5 relative), and the client state comes back. Then the
refusals: a checkpoint without scheduler state under ``strict``, and a
client state that would not read back, refused on every rank before a byte
is written.

The worker functions below run on the ranks of a ``Cluster`` (spawned
processes import this module by name: pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

from zerobridge.checkpoint.run_state import restore_scheduler
from zerobridge.harness.cluster import Cluster, RankError
from zerobridge.testing.parity import ParityNet, make_optimizer
from zerobridge.testing.resume import train_steps

pytestmark = pytest.mark.distributed

ME = "test_checkpoint_schedule"
STEPS, SAVED_AT, RTOL = 6, 3, 1e-5
ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
GROUPS = [{"lr": 3e-2, "weight_decay": 0.1}, {"lr": 3e-2, "weight_decay": 0.0}]


def schedule(step: int) -> float:
    """Warm up over 3 steps, then decay by 0.7 a step: every step's lr differs."""
    return min(1.0, (step + 1) / 3) * 0.7 ** max(0, step - 2)


class Opaque:
    """An object ``torch.load(weights_only=True)`` refuses: no checkpoint may hold it."""


# ---------------------------------------------------------------------------- workers (every rank)

def _run(seed: int, backend: str, stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                       torch.optim.lr_scheduler.LambdaLR]:
    import zerobridge

    model = ParityNet(seed)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    model, optimizer = zerobridge.prepare(model, optimizer, backend=backend, stage=stage)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: range
           ) -> tuple[list[float], list[float]]:
    """Losses and the lr each step ran with."""
    import zerobridge

    losses, lrs = [], []
    for step in steps:
        lrs.append(optimizer.param_groups[0]["lr"])
        losses += train_steps(model, optimizer, range(step, step + 1), lambda m: zerobridge.clip_grad_norm_(m, 1.0))
        scheduler.step()
    return losses, lrs


def save_run(*, path: str, backend: str, stage: int) -> dict[str, Any]:
    import zerobridge

    model, optimizer, scheduler = _run(0, backend, stage)
    losses, lrs = _train(model, optimizer, scheduler, range(SAVED_AT))
    client = {"epoch": 2, "rank": dist.get_rank(), "seen": torch.arange(3), "pairs": {(1, 2): ("x", None)}}
    zerobridge.save_checkpoint(path, model, optimizer, scheduler=scheduler, client_state=client,
                               metadata={"step": SAVED_AT})
    return {"losses": losses, "lrs": lrs}


def resume_run(*, path: str, backend: str, stage: int) -> dict[str, Any]:
    import zerobridge

    model, optimizer, scheduler = _run(7, backend, stage)
    for group in optimizer.param_groups:  # the checkpoint must put the saved values back
        group["lr"], group["weight_decay"] = 1.0, 0.5
    loaded = zerobridge.load_checkpoint(path, model, optimizer, scheduler=scheduler)
    position = scheduler.last_epoch
    losses, lrs = _train(model, optimizer, scheduler, range(SAVED_AT, STEPS))
    return {"loaded": loaded, "position": position, "losses": losses, "lrs": lrs}


def save_plain(*, path: str) -> None:
    import zerobridge

    model, optimizer, _ = _run(0, "native", 1)
    zerobridge.save_checkpoint(path, model, optimizer, metadata={"step": 0})


def load_strictly(*, path: str, strict: bool) -> dict[str, Any]:
    import zerobridge

    model, optimizer, scheduler = _run(7, "native", 1)
    loaded = zerobridge.load_checkpoint(path, model, optimizer, scheduler=scheduler, strict=strict)
    return {"loaded": loaded, "position": scheduler.last_epoch}


def save_opaque(*, path: str) -> None:
    """Rank 1 alone holds an object that would not read back: every rank must raise, none hang."""
    import zerobridge

    model, optimizer, scheduler = _run(0, "native", 2)
    client = {"state": Opaque() if dist.get_rank() == 1 else 1}
    zerobridge.save_checkpoint(path, model, optimizer, scheduler=scheduler, client_state=client)


# ---------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, Cluster]]:
    with ExitStack() as stack:
        yield {n: stack.enter_context(Cluster(n, timeout_s=300, env=ENV)) for n in (1, 2)}


@cache
def reference() -> tuple[list[float], list[float]]:
    """The uninterrupted run: one process, the whole batch, plain torch."""
    model = ParityNet(0)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        losses += train_steps(model, optimizer, range(step, step + 1),
                              lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        scheduler.step()
    return losses, lrs


_SAVED: dict[tuple[str, int], tuple[Path, list[Any]]] = {}


def saved(clusters: dict[int, Cluster], root: Path, backend: str, stage: int) -> tuple[Path, list[Any]]:
    """One save per (backend, stage) for the module."""
    if (backend, stage) not in _SAVED:
        path = root / f"{backend}-{stage}"
        _SAVED[backend, stage] = path, clusters[2].run(f"{ME}:save_run", path=str(path), backend=backend,
                                                       stage=stage)
    return _SAVED[backend, stage]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("schedule")


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) > 0 and all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want))


@pytest.mark.parametrize(("saver", "saved_stage", "loader", "stage", "world"), [
    ("native", 2, "fsdp", 3, 2),
    ("native", 2, "native", 0, 1),
    ("fsdp", 3, "deepspeed", 2, 2),
    ("deepspeed", 1, "native", 3, 2),
], ids=["native2-fsdp3", "native2-world1", "fsdp3-deepspeed2", "deepspeed1-native3"])
def test_the_schedule_and_client_state_resume_anywhere(clusters: dict[int, Cluster], root: Path, saver: str,
                                                       saved_stage: int, loader: str, stage: int,
                                                       world: int) -> None:
    if "deepspeed" in (saver, loader):
        pytest.importorskip("deepspeed")
    losses, lrs = reference()
    path, before = saved(clusters, root, saver, saved_stage)
    assert close(before[0]["losses"], losses[:SAVED_AT]) and before[0]["lrs"] == lrs[:SAVED_AT]
    results = clusters[world].run(f"{ME}:resume_run", path=str(path), backend=loader, stage=stage)
    for result in results:
        assert isinstance(result, dict)
        client = result["loaded"].pop("client_state")
        assert result["loaded"] == {"step": SAVED_AT}
        assert client["epoch"] == 2 and client["rank"] == 0  # rank 0's client state, on every rank
        assert torch.equal(client["seen"], torch.arange(3)) and client["pairs"] == {(1, 2): ("x", None)}
        assert result["position"] == SAVED_AT
        assert result["lrs"] == lrs[SAVED_AT:], "the next lrs are the uninterrupted run's"
        assert close(result["losses"], losses[SAVED_AT:]), (result["losses"], losses[SAVED_AT:])


def test_a_checkpoint_without_scheduler_state(clusters: dict[int, Cluster], root: Path) -> None:
    path = root / "plain"
    clusters[1].run(f"{ME}:save_plain", path=str(path))
    with pytest.raises(RankError) as caught:
        clusters[1].run(f"{ME}:load_strictly", path=str(path), strict=True)
    text = str(caught.value)
    assert "zerobridge.scheduler: holds no learning-rate scheduler state" in text
    assert "fix: load with scheduler=None" in text and "strict=False" in text
    skipped = clusters[1].run(f"{ME}:load_strictly", path=str(path), strict=False)[0]
    assert skipped == {"loaded": {"step": 0}, "position": 0}  # no client_state key: none was saved


def test_client_state_that_would_not_read_back_is_refused_on_every_rank(clusters: dict[int, Cluster],
                                                                       root: Path) -> None:
    path = root / "opaque"
    with pytest.raises(RankError) as caught:
        clusters[2].run(f"{ME}:save_opaque", path=str(path))
    assert sorted(caught.value.tracebacks) == [0, 1]  # both ranks raise; none hangs
    assert f"{ME}.Opaque" in caught.value.tracebacks[1] and "weights_only" in caught.value.tracebacks[1]
    assert "another rank failed" in caught.value.tracebacks[0]
    assert not path.exists() and not list(root.glob(".opaque*"))


def test_schedules_resume_across_the_two_state_forms() -> None:
    """DeepSpeed's ``{"last_batch_iteration": n}`` into a torch scheduler, and the DeepSpeed-equivalent
    schedules of ``zerobridge.runtime.lr_schedules`` from either form: the same next lrs."""
    from zerobridge.runtime.lr_schedules import build_scheduler

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    def lrs(opt: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            opt.step()
            scheduler.step()
            out.append(opt.param_groups[0]["lr"])
        return out

    section = {"type": "WarmupLR", "params": {"warmup_num_steps": 6, "warmup_type": "linear", "warmup_max_lr": 1.0}}
    ran_opt = optimizer()
    ran = build_scheduler(section, ran_opt)
    lrs(ran_opt, ran, 4)
    saved, lr = ran.state_dict(), ran_opt.param_groups[0]["lr"]
    want = lrs(ran_opt, ran, 3)
    for state in (saved, {"last_batch_iteration": saved["last_batch_iteration"]}):
        opt = optimizer()
        fresh = build_scheduler(section, opt)
        opt.param_groups[0]["lr"] = lr  # what load_checkpoint restores with the param groups
        restore_scheduler(fresh, state)
        assert lrs(opt, fresh, 3) == want, state

    torch_opt = optimizer()
    lambdas = torch.optim.lr_scheduler.LambdaLR(torch_opt, schedule)
    restore_scheduler(lambdas, {"last_batch_iteration": 3})  # four steps taken
    assert lambdas.last_epoch == 4 and lambdas.get_last_lr() == [torch_opt.param_groups[0]["lr"]]
    assert lrs(torch_opt, lambdas, 2) == [0.1 * schedule(5), 0.1 * schedule(6)]
