"""Give an engine built from a meta-device model its initial values, one module at a time.

    >>> import torch, zerobridge
    >>> _ = torch.manual_seed(0); eager = torch.nn.Linear(4, 2)
    >>> _ = torch.manual_seed(0)
    >>> with torch.device("meta"):
    ...     lazy = torch.nn.Linear(4, 2)
    >>> lazy = zerobridge.prepare(lazy, stage=3)          # groups allocated, values replayed
    >>> torch.equal(zerobridge.full_state_dict(lazy)["weight"], eager.weight)
    True

The engine's flat groups are allocated empty from the meta shapes (a rank's
shard at stage 3, the full replica at stages 0-2). Then, module by module in
registration order, the construction replay (``zerobridge/runtime/deferred_init.py``)
produces that module's tensors on the CPU; each parameter's run that this
rank holds is written into the master elements (``master.write_master``,
which also reaches offload tiers), and the full tensor is dropped. Buffers
are small and kept whole. A last collective pass pushes masters into the
compute copies, as after a checkpoint load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerobridge.engine.local_runs import local_runs, refresh_compute, write_master
from zerobridge.runtime.deferred_init import Replay

if TYPE_CHECKING:
    from zerobridge.engine.engine import Engine

__all__ = ["materialize_engine"]


def materialize_engine(engine: Engine, replay: Replay) -> None:
    """Write every parameter run this rank holds and every buffer from ``replay``
    (already recorded). Collective: ends with ``refresh_compute``."""
    runs: dict[int, list] = {}
    for run in local_runs(engine):
        if run.numel > 0:
            runs.setdefault(run.group.refs[run.index].source_id, []).append(run)
    buffers = {key for key, (_, _, is_buffer) in replay.first.items() if is_buffer}
    for key, value in replay.by_module(lambda key: key in runs or key in buffers):
        if key in buffers:
            replay.put_buffer(key, value, engine.device)
            continue
        flat = value.reshape(-1)
        for run in runs[key]:
            piece = flat[run.start:run.start + run.numel]
            write_master(engine, run, piece)
        del value, flat
    refresh_compute(engine)
