"""One planning worker: ``python -m zerobridge.planning.worker TASK RESULT``, a program of its own.

``planner`` starts one per batch of candidates. It reads the pickled task
(the model's name, the specs, the run, ``whole``, the flavor) from the file TASK,
measures each spec and writes the pickled list of ``FlavorMeasured`` to RESULT, or
the exception it raised. Being its own program, it never imports the
caller's ``__main__``, so ``zerobridge.plan(...)`` works from a plain script
with no ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from zerobridge.planning.flavors import measure_flavor_ref

__all__ = ["main"]


def main(task: Path, result: Path) -> int:
    """Measure the specs of ``task``; 0 when every one was measured, 1 when one raised (pickled too)."""
    ref, specs, run, whole, flavor = pickle.loads(task.read_bytes())
    try:
        value: object = [measure_flavor_ref(ref, spec, run, whole, flavor) for spec in specs]
        code = 0
    except Exception as exc:  # the caller raises it again, as if measured in its own process
        value, code = exc, 1
    result.write_bytes(pickle.dumps(value))
    return code


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
