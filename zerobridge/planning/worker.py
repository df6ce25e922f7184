"""Planning workers: candidates measured side by side, in forked processes or in programs of their own.

    >>> from zerobridge.planning.worker import fork_map
    >>> fork_map(lambda i: i * i, 4, workers=2)
    [0, 1, 4, 9]

``fork_map`` is what ``planner`` uses where it can: processes forked from the
planning process, so they start in milliseconds with torch, transformers and
the model's source already imported and built (a fresh interpreter spends 5-10 s
of CPU on that, per worker), and each takes the next candidate as it finishes
one (the costs differ by 3x between candidates). A fork never runs the caller's
``__main__`` again, so a plain script needs no ``if __name__ == "__main__":``
guard. Where forking is not for this process (no ``fork`` start method, or a
process group the children would inherit) ``fork_map`` declines and ``main``
is the fallback: ``python -m zerobridge.planning.worker TASK RESULT``, a program
of its own that reads the pickled task (the model's name, each spec with its flavor,
the run, ``whole``) from the file TASK, measures each spec and writes the
pickled list of ``FlavorMeasured`` to RESULT, or the exception it raised.
"""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from zerobridge.planning.fake_run import Run
from zerobridge.planning.flavors import FlavorMeasured, measure_flavor_ref
from zerobridge.spec import StrategySpec

__all__ = ["fork_map", "main", "program_map"]

T = TypeVar("T")

_JOB: Callable[[int], object] | None = None
"""What the forked workers of the running ``fork_map`` call (inherited by the fork, never pickled)."""


def _call(index: int) -> object:
    assert _JOB is not None
    return _JOB(index)


def fork_map(job: Callable[[int], T], count: int, *, workers: int) -> list[T] | None:
    """``[job(0), ..., job(count - 1)]`` computed by ``workers`` processes forked from this one, each
    taking the next index as it finishes one; an exception ``job`` raises is raised here. ``None`` when
    this process cannot fork its workers (no ``fork`` start method, or it is in a process group)."""
    global _JOB
    if "fork" not in multiprocessing.get_all_start_methods() or (dist.is_available() and dist.is_initialized()):
        return None
    _JOB = job
    try:
        with ProcessPoolExecutor(max(1, min(workers, count)), mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_call, range(count)))  # type: ignore[arg-type]
    except BrokenProcessPool as exc:
        raise RuntimeError("a planning worker died without a result (out of memory?): plan with workers=1 to "
                           "see its error in this process") from exc
    finally:
        _JOB = None


def program_map(ref: str, specs: list[StrategySpec], run: Run, whole: bool, flavor: str | Sequence[str], *,
                workers: int) -> list[FlavorMeasured]:
    """Every spec of ``specs`` measured on ``flavor`` (or each on its own: one flavor per spec) by ``workers``
    programs of their own (``python -m zerobridge.planning.worker TASK RESULT``: fresh interpreters with their
    own fake process group, for a process already in a group, which ``fork_map`` declines); ``ref`` names the
    model again there."""
    flavors = [flavor] * len(specs) if isinstance(flavor, str) else list(flavor)
    count = max(1, min(workers, len(specs)))
    batches = [list(range(i, len(specs), count)) for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="zerobridge-plan-") as folder:
        started = []
        for n, batch in enumerate(batches):
            task, result = Path(folder, f"task{n}.pkl"), Path(folder, f"result{n}.pkl")
            task.write_bytes(pickle.dumps((ref, [(specs[i], flavors[i]) for i in batch], run, whole)))
            with open(Path(folder, f"err{n}.log"), "wb") as err:  # a file: a full pipe would block the worker
                started.append((subprocess.Popen([sys.executable, "-m", "zerobridge.planning.worker", str(task),
                                                  str(result)], stdout=subprocess.DEVNULL, stderr=err), result))
        measured: dict[int, FlavorMeasured] = {}
        for n, (batch, (proc, result)) in enumerate(zip(batches, started)):
            proc.wait()
            value = pickle.loads(result.read_bytes()) if result.exists() else None
            if isinstance(value, Exception):
                raise value
            if not isinstance(value, list):
                text = Path(folder, f"err{n}.log").read_text(errors="replace")
                last = (text.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"a planning worker (python -m zerobridge.planning.worker) exited "
                                   f"{proc.returncode} without a result: {last}")
            measured.update(zip(batch, value))
    return [measured[i] for i in range(len(specs))]


def main(task: Path, result: Path) -> int:
    """Measure the specs of ``task``; 0 when every one was measured, 1 when one raised (pickled too)."""
    ref, jobs, run, whole = pickle.loads(task.read_bytes())
    try:
        value: object = [measure_flavor_ref(ref, spec, run, whole, flavor) for spec, flavor in jobs]
        code = 0
    except Exception as exc:  # the caller raises it again, as if measured in its own process
        value, code = exc, 1
    result.write_bytes(pickle.dumps(value))
    return code


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
