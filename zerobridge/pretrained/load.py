"""Pretrained weights into the runs a rank holds, each rank reading only its own bytes.

    >>> import tempfile, torch, zerobridge
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> path = Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(path))
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(3, 2)
    >>> model = zerobridge.prepare(model, stage=3)
    >>> report = zerobridge.load_pretrained(model, path)
    >>> zerobridge.full_state_dict(model)["weight"].sum().item(), report.loaded
    (6.0, 2)

``zerobridge.load_pretrained`` (``api.py``) asks the model's backend for
its targets and calls ``write_weights``. ``source``: a safetensors file, a
Hugging Face model directory (one file or shards with an index), a ``.bin``
/ ``.pt`` state dict (``weights_only``); a checkpoint directory
(``zerobridge.save_checkpoint`` or ``torch.distributed.checkpoint``) is
resharded by ``load_checkpoint`` instead.

Names: a parameter is found under any of its names (tied ones have several),
as is, with ``model.`` (or the model's ``base_model_prefix``) added, or with
it removed, so a base-model checkpoint loads into a model with a head and the
reverse. Missing, unexpected and mismatched-shape tensors are one error
listing them all, raised on every rank alike before anything is written
(``strict=False``: missing and unexpected ones are reported, not refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from zerobridge.errors import ConfigError
from zerobridge.pretrained.files import Weights, open_weights
from zerobridge.pretrained.targets import Target

__all__ = ["LoadReport", "match_names", "write_weights"]


@dataclass
class LoadReport:
    """What ``load_pretrained`` did on this rank."""

    source: str
    loaded: int = 0
    """Tensors found in the source."""
    bytes_read: int = 0
    """Bytes this rank read from the source's tensors."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Model name -> source name, where they differ."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def match_names(targets: Iterable[tuple[str, ...]], available: Iterable[str], prefixes: Iterable[str]
                ) -> tuple[list[str | None], list[str]]:
    """For each target's names, the source name it loads from (``None``: missing),
    and the source names nothing uses."""
    present = set(available)
    fixes = [p for p in dict.fromkeys(prefixes) if p]
    used: set[str] = set()
    chosen: list[str | None] = []
    for names in targets:
        found = None
        for name in names:
            candidates = [name, *(p + name for p in fixes), *(name[len(p):] for p in fixes if name.startswith(p))]
            hits = [c for c in candidates if c in present]
            used.update(hits)
            if hits and found is None:
                found = hits[0]
        chosen.append(found)
    return chosen, sorted(present - used)


def _prefixes(model: nn.Module) -> list[str]:
    base = getattr(model, "base_model_prefix", "") or ""
    return ["model.", f"{base}." if base else ""]


def write_weights(model: nn.Module, source: str | Path, targets: list[Target], *, strict: bool = True) -> LoadReport:
    """Write the weights in the file or Hugging Face directory ``source`` into ``targets`` (the runs this
    rank holds, as its backend lists them), matching names against ``model``'s; each run reads only
    its own bytes, cast to the target's dtype. Returns the report; ``ConfigError`` (on every rank
    alike, before anything is written) when the names or shapes do not fit."""
    weights = open_weights(Path(source))
    chosen, unexpected = match_names([t.names for t in targets], weights.entries, _prefixes(model))
    report = _check(model, weights, targets, chosen, unexpected, strict=strict)
    with torch.no_grad():
        for target, name in zip(targets, chosen):
            if name is None or target.numel == 0:
                continue
            values = weights.read(name, target.start, target.start + target.numel)
            report.bytes_read += values.numel() * values.element_size()
            target.write(values)
    return report


def _check(model: nn.Module, weights: Weights, targets: list[Target], chosen: list[str | None],
           unexpected: list[str], *, strict: bool) -> LoadReport:
    """The report of loading ``chosen`` names into ``targets``; one error listing every
    mismatch (and, under ``strict``, every missing and unexpected tensor)."""
    report = LoadReport(source=str(weights.source))
    missing, shapes = [], []
    seen: set[tuple[str, ...]] = set()
    for target, name in zip(targets, chosen):
        if target.names in seen:
            continue
        seen.add(target.names)
        if name is None:
            missing.append(target.names[0])
            continue
        report.loaded += 1
        if name != target.names[0]:
            report.renamed[target.names[0]] = name
        if weights.entries[name].shape != tuple(target.shape):
            shapes.append(f"{name}: {list(weights.entries[name].shape)} in the file, {list(target.shape)} in the model")
    report.missing, report.unexpected = missing, unexpected
    problems = []
    if shapes:
        problems.append(f"shapes differ for {'; '.join(shapes[:8])}")
    if strict and missing:
        problems.append(f"missing from the file: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"in the file but not the model: {', '.join(unexpected[:8])}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    if problems:
        raise ConfigError(f"{weights.source} does not fit {type(model).__name__}: {'; '.join(problems)}",
                          source=weights.source, key="source",
                          fix="load the checkpoint of this architecture and size"
                              + ("" if shapes else ", or pass strict=False to load what matches"))
    return report
