"""zerobridge: one partitioning spec for DeepSpeed ZeRO and PyTorch FSDP.

    >>> import zerobridge
    >>> callable(zerobridge.prepare)
    True

The training API (``prepare``, ``clip_grad_norm_``, ``full_state_dict``,
``stats``, ``reset_stats``, ``spec_of``, ``is_accumulation_boundary``) and checkpoints (``save_checkpoint``,
``load_checkpoint``, ``save_full``, ``load_pretrained``) live in
``zerobridge.api``, ``plan`` (which strategy fits) in ``zerobridge.planning``; they load torch on
first use here, so config conversion stays fast.

[Note: layers]
The package is cut into layers, bottom first (``LAYERS``). A module imports
only from its own layer or the layers below it, never above, and no imports
form a cycle: ``tests/test_layers.py`` walks every import (at module top,
inside functions, under ``TYPE_CHECKING``, and module names in strings) and
fails on any that breaks this. An import inside a function is there only to
keep a heavy dependency (torch, deepspeed, transformers, matplotlib) off the
importer's start-up, with the reason on its line.

 0  base         ``_version``, ``errors``, ``resources``, ``references``: import nothing of zerobridge
                 but ``errors``
 1  spec         the partitioning spec (pydantic, frozen), stage presets
 2  env          every ``ZEROBRIDGE_*`` variable and its grammar
 3  translators  ``translate/`` (tables in ``mappings/``), ``registry``, ``load``, ``explain``,
                 ``diff``: torch-free data work
 4  distributed  process groups and devices (``distributed``); the built-in models (``models/``)
 5  runtime      the run rules every backend shares (``runtime/``): plan, accumulation
                 window, step rules, loss scaling, wrap units, compile, comm stats, deferred init
 6  mechanisms   the native engine (``engine/``), the checkpoint format (``checkpoint/``),
                 pretrained weight files (``pretrained/``): independent of one another
 7  backends     one folder per backend (``backends/native``, ``fsdp``, ``deepspeed``) with the
                 same file names, the ``Backend`` interface, preflight checks
 8  api          the public calls; ``prepare`` dispatches to a backend
 9  tools        ``launch`` (``zerobridge run``), ``harness/`` (spawned process groups),
                 ``compare/``, ``docgen`` (and its ``docgen_sections``), ``deepspeed/`` (DeepSpeed's
                 entry points over the api), ``plan/`` (which strategy fits, measured on fake tensors)
10  entry        ``cli``, ``demo``, ``testing/`` (test and bench workers), this facade

docs/architecture.md has a paragraph per layer and where a new backend or
translator goes.
"""

from __future__ import annotations

from typing import Any

from zerobridge._version import __version__ as __version__

__all__ = ["clip_grad_norm_", "full_state_dict", "is_accumulation_boundary", "latest_checkpoint", "load_checkpoint",
           "load_pretrained", "plan", "prepare", "reset_stats", "save_checkpoint", "save_full", "spec_of", "stats"]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("zerobridge._version", "zerobridge.errors", "zerobridge.resources", "zerobridge.references"),
    ("zerobridge.spec",),
    ("zerobridge.env",),
    ("zerobridge.translate", "zerobridge.registry", "zerobridge.load", "zerobridge.explain", "zerobridge.diff"),
    ("zerobridge.distributed", "zerobridge.models"),
    ("zerobridge.runtime",),
    ("zerobridge.engine", "zerobridge.checkpoint", "zerobridge.pretrained"),
    ("zerobridge.backends",),
    ("zerobridge.api",),
    ("zerobridge.launch", "zerobridge.harness", "zerobridge.compare", "zerobridge.docgen", "zerobridge.docgen_sections",
     "zerobridge.deepspeed", "zerobridge.planning"),
    ("zerobridge.cli", "zerobridge.demo", "zerobridge.testing", "zerobridge"),
)
"""The layers, bottom first (the note above); ``zerobridge`` alone names this module, not the package."""
INDEPENDENT = frozenset({6})
"""Layers whose groups never import one another."""


def __getattr__(name: str) -> Any:
    if name == "plan":
        from zerobridge.planning import planner  # lazy: the planner loads torch

        return planner.plan
    if name in __all__:
        from zerobridge import api  # lazy: loads torch, which converting a config never needs

        return getattr(api, name)
    raise AttributeError(f"module 'zerobridge' has no attribute {name!r}")
