"""The runs ``load_pretrained`` writes on the native engine: one per parameter run this rank holds.

    >>> import torch, zerobridge
    >>> from zerobridge.backends.base import backend_of
    >>> model = zerobridge.prepare(torch.nn.Linear(3, 2), stage=3)
    >>> [(t.names, t.shape, t.start, t.numel) for t in backend_of(model).pretrained_targets()]
    [(('weight',), (2, 3), 0, 6), (('bias',), (2,), 0, 2)]

Each run is written into the master elements wherever they live (device,
host or nvme tier, ``engine/local_runs.py``); ``refresh_compute`` then pushes the
masters into the compute copies.
"""

from __future__ import annotations

import functools

from zerobridge.engine.engine import Engine
from zerobridge.engine.local_runs import local_runs, write_master
from zerobridge.pretrained.targets import Target, buffer_targets

__all__ = ["engine_targets"]


def engine_targets(engine: Engine) -> list[Target]:
    """Every parameter run of the native engine on this rank, then the buffers."""
    runs = [Target(run.names, tuple(run.shape), run.start, run.numel, functools.partial(write_master, engine, run))
            for run in local_runs(engine)]
    return runs + buffer_targets(engine.model)


