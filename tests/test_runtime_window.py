"""The accumulation window every backend follows (no process group needed)."""

from __future__ import annotations

import pytest

from zerobridge.runtime.window import AccumulationWindow, WindowState
from zerobridge.spec import GradSync


def run(window: AccumulationWindow, passes: list[bool]) -> list[tuple[bool, bool, bool]]:
    """(boundary, reduces, closed) of each backward pass; ``True`` in ``passes`` runs it inside no_sync."""
    out = []
    for quiet in passes:
        if quiet:
            with window.no_sync():
                window.begin()
                boundary, reduces = window.boundary, window.reduces
                closed = window.end()
        else:
            window.begin()
            boundary, reduces = window.boundary, window.reduces
            closed = window.end()
        out.append((boundary, reduces, closed))
    return out


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_every_nth_backward_closes_the_window(steps: int) -> None:
    window = AccumulationWindow(steps, GradSync.ACCUMULATION_BOUNDARY)
    got = run(window, [False] * (2 * steps))
    closes = [closed for _, _, closed in got]
    assert closes == ([False] * (steps - 1) + [True]) * 2
    assert all(reduces == boundary for boundary, reduces, _ in got)  # only the boundary reduces
    assert window.state is WindowState.EMPTY and window.micro == 0


def test_every_micro_step_reduces_between_boundaries() -> None:
    window = AccumulationWindow(3, GradSync.EVERY_MICRO_STEP)
    assert [r for _, r, _ in run(window, [False, False, False])] == [True, True, True]


def test_no_sync_never_closes_and_never_reduces() -> None:
    window = AccumulationWindow(2, GradSync.EVERY_MICRO_STEP)
    got = run(window, [True, True, True, False])
    assert got[:3] == [(False, False, False)] * 3
    assert got[3] == (True, True, True)  # the first pass outside reduces everything


def test_states_and_the_window_opening() -> None:
    window = AccumulationWindow(2)
    assert window.state is WindowState.EMPTY and not window.in_backward
    assert window.begin() is True and window.in_backward
    window.end()
    assert window.state is WindowState.ACCUMULATING
    assert window.begin() is False  # the same window goes on
    assert window.end() is True and window.state is WindowState.EMPTY


def test_misuse_is_an_error() -> None:
    window = AccumulationWindow(1)
    with pytest.raises(RuntimeError, match="never began"):
        window.end()
    window.begin()
    with pytest.raises(RuntimeError, match="while another one was running"):
        window.begin()
