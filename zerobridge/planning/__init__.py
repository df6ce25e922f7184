"""``zerobridge plan`` / ``zerobridge.plan(...)``: which strategy fits, measured before anything launches.

    >>> import zerobridge
    >>> result = zerobridge.plan("tiny-gpt", world_size=8, nodes=2, device_memory="40MiB", micro_batch=4, seq_len=32,
    ...                          workers=1)
    >>> result.recommended.name
    'zero2'
    >>> [r.name for r in result.rows][:4]
    ['zero0', 'zero1', 'zero2', 'zero3']

    zerobridge plan llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --micro-batch 1 --seq-len 4096
    zerobridge plan path/to/config.json --world-size 8 --device-memory 24GiB --to deepspeed -o ds.json

The model (a built-in, a Hugging Face config.json, ``pkg.module:factory``) is
built on the meta device; every candidate layout trains two steps as one
rank, on fake tensors and a fake process group, so a 405B model plans on a
laptop: on the native engine, on the FSDP2 backend, or as DeepSpeed holds it
(``flavor=``; ``flavors`` says how each is measured, ``planner`` explains the
figures; docs/plan.md has the measured accuracy per flavor).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Plan", "Row", "plan"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from zerobridge.planning import planner  # lazy: torch, which registering `zerobridge plan` never needs

        return getattr(planner, name)
    raise AttributeError(f"module 'zerobridge.planning' has no attribute {name!r}")
