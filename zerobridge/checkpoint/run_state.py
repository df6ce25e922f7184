"""What a checkpoint carries of the run besides model and optimizer: the LR scheduler's state and the client state.

    >>> import torch
    >>> from zerobridge.checkpoint.run_state import restore_scheduler
    >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    >>> restore_scheduler(scheduler, {"last_batch_iteration": 3})   # a DeepSpeed schedule's state: 4 steps taken
    >>> scheduler.last_epoch
    4
    >>> optimizer.step(); scheduler.step()                          # the fifth step
    >>> optimizer.param_groups[0]["lr"]                             # 0.5 ** 5
    0.03125

``save_checkpoint(scheduler=..., client_state=...)`` stores the scheduler's
``state_dict()`` under ``SCHEDULER_KEY`` and the client state under
``CLIENT_STATE_KEY``: plain values written once, by rank 0, beside the user
metadata, and read back with ``torch.load(weights_only=True)`` like every
other item (no code runs on load). What cannot come back that way is
refused when saving (``check_run``), before a byte is written.

Schedulers come in two forms. torch's ``LRScheduler`` state counts steps in
``last_epoch`` (0 when built, one more per ``step()``); DeepSpeed's schedules
(``deepspeed.runtime.lr_schedules``) keep only ``{"last_batch_iteration": n}``
(-1 when built), so ``last_epoch == last_batch_iteration + 1`` after the same
steps. ``restore_scheduler`` hands each scheduler the form it takes: a
scheduler with a ``last_batch_iteration`` attribute (DeepSpeed's own, and
``zerobridge.runtime.lr_schedules``' equivalents) gets DeepSpeed's, any other
torch ``LRScheduler`` torch's.

This module loads nothing but torch (``zerobridge.api`` imports it on every
run); reading and writing the items is ``metadata.py``'s.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.optim.lr_scheduler import LRScheduler

from zerobridge.checkpoint.layout import ZB
from zerobridge.checkpoint.storage import CheckpointError

__all__ = ["CLIENT_STATE", "CLIENT_STATE_KEY", "SCHEDULER_KEY", "RunState", "Stateful", "check_loadable", "check_run",
           "restore_scheduler", "resumed", "run_state"]

SCHEDULER_KEY = f"{ZB}.scheduler"
"""The LR scheduler's ``state_dict()``."""
CLIENT_STATE_KEY = f"{ZB}.client_state"
"""``save_checkpoint(client_state=...)``."""
CLIENT_STATE = "client_state"
"""The key ``load_checkpoint``'s returned dict holds the client state under."""


@runtime_checkable
class Stateful(Protocol):
    """What a scheduler must offer to be checkpointed: any torch ``LRScheduler``, DeepSpeed's schedules."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds of the run besides model, optimizer, RNG and loss scaler."""

    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-able user metadata."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's ``state_dict()``; ``None``: none saved."""
    client_state: dict[str, Any] | None = None
    """Plain values (DeepSpeed's ``client_state``); ``None``: none saved."""


def _cause(exc: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words."""
    text = str(exc).strip()
    found = re.search(r"GLOBAL (\S+)|function (\S+)", text)
    if found:
        return f"it holds a {next(g for g in found.groups() if g)}"
    detail = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    return (detail.group(1) if detail else (text.splitlines() or [type(exc).__name__])[0])[:200]


def check_loadable(value: Any, key: str, fix: str) -> None:
    """Refuse ``value`` unless ``torch.load(weights_only=True)`` reads back what ``torch.save`` writes of it
    (what a checkpoint reader does): numbers, strings, lists, tuples, dicts, tensors, ..."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot be read back by torch.load(weights_only=True), which checkpoints are read "
                              f"with ({_cause(exc)})", key=key, fix=fix) from None


def run_state(metadata: dict[str, Any] | None, scheduler: Stateful | None,
              client_state: dict[str, Any] | None) -> RunState:
    """What ``save_checkpoint`` writes of the run: the metadata, the scheduler's ``state_dict()`` and the client
    state (``check_run`` checks that they read back)."""
    state: dict[str, Any] | None = None
    if scheduler is not None:
        if not isinstance(scheduler, Stateful):
            raise CheckpointError(f"a {type(scheduler).__name__} has no state_dict() and load_state_dict()",
                                  key="scheduler", fix="pass a torch.optim.lr_scheduler.LRScheduler (or None)")
        state = scheduler.state_dict()
        if not isinstance(state, dict):
            raise CheckpointError(f"{type(scheduler).__name__}.state_dict() returned a {type(state).__name__}, "
                                  "not a dict", key="scheduler", fix="pass a torch LRScheduler")
    if client_state is not None and not isinstance(client_state, dict):
        raise CheckpointError(f"is a {type(client_state).__name__}, not a dict", key="client_state",
                              fix="pass a dict, as DeepSpeed's save_checkpoint(client_state=...) takes")
    return RunState(metadata=dict(metadata or {}), scheduler=state, client_state=client_state)


def check_run(run: RunState) -> None:
    """Refuse, before anything is written, a scheduler state or client state that would not read back, and
    metadata holding the key the client state comes back under."""
    if run.scheduler is not None:
        check_loadable(run.scheduler, SCHEDULER_KEY, "the scheduler's state_dict() must hold plain values only "
                       "(a scheduler holding objects, e.g. a callable class as its lambda, cannot be saved): save "
                       "with scheduler=None and rebuild the scheduler at the saved step")
    if run.client_state is not None:
        if CLIENT_STATE in run.metadata:
            raise CheckpointError(f"metadata holds {CLIENT_STATE!r}, the key load_checkpoint returns client_state "
                                  "under", key=f"metadata.{CLIENT_STATE}",
                                  fix="rename that metadata key, or move it into client_state")
        check_loadable(run.client_state, CLIENT_STATE_KEY, "keep client_state to numbers, strings, booleans, None, "
                       "lists, tuples, dicts and tensors (a checkpoint runs no code when read): store other "
                       "objects as their state_dict() or as plain values")


def _deepspeed_form(state: dict[str, Any]) -> bool:
    return "last_batch_iteration" in state and "last_epoch" not in state


def restore_scheduler(scheduler: Stateful, state: dict[str, Any]) -> None:
    """Load a saved ``state_dict()`` into ``scheduler``, translating DeepSpeed's ``{"last_batch_iteration": n}``
    and torch's ``last_epoch`` into the form ``scheduler`` takes (the same number of steps taken).

    A torch ``LRScheduler`` given DeepSpeed's form resumes at ``last_epoch = n + 1`` with the optimizer's
    current lrs as its last ones (``load_checkpoint`` restored them with the param groups); the next
    ``step()`` computes the schedule there."""
    takes_deepspeed = hasattr(scheduler, "last_batch_iteration")
    if _deepspeed_form(state) and not takes_deepspeed:
        if not isinstance(scheduler, LRScheduler):
            raise CheckpointError(f"holds a DeepSpeed schedule's state {state}, which a {type(scheduler).__name__} "
                                  "does not take", key=SCHEDULER_KEY,
                                  fix="pass a torch LRScheduler or a DeepSpeed-style schedule (zerobridge.runtime."
                                      "lr_schedules builds them from the JSON's scheduler section)")
        steps = int(state["last_batch_iteration"]) + 1
        scheduler.last_epoch = steps
        scheduler._step_count = steps + 1  # built: 1, then one per step(), as torch counts
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        return
    if not _deepspeed_form(state) and takes_deepspeed and not isinstance(scheduler, LRScheduler) \
            and "last_epoch" in state:  # DeepSpeed's own class, from a torch scheduler's state
        scheduler.load_state_dict({"last_batch_iteration": int(state["last_epoch"]) - 1})
        return
    scheduler.load_state_dict(state)


def resumed(run: RunState, scheduler: Stateful | None) -> dict[str, Any]:
    """Restore ``scheduler`` from ``run`` (the loader already refused a missing state under ``strict``) and
    return what ``load_checkpoint`` returns: the metadata, plus ``"client_state"`` when one was saved."""
    if scheduler is not None and run.scheduler is not None:
        restore_scheduler(scheduler, run.scheduler)
    out = dict(run.metadata)
    if run.client_state is not None:
        out[CLIENT_STATE] = run.client_state
    return out
