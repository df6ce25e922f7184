"""One entry point for "a strategy, however the user names it".

    >>> from zerobridge.load import load_spec
    >>> load_spec("zero2-offload").value.offload.optimizer.device.value
    'cpu'

A path to a DeepSpeed JSON, Accelerate YAML, FSDP kwargs JSON, torchtitan
TOML or spec file; a registry name or alias; a Lightning strategy name; an
Accelerate sharding code; a dict in DeepSpeed form; or a spec.

It sits beside ``registry.py``, above ``translate/``: it resolves names through
the registry, which reads its entries through the translators, so inside
``translate/`` it would close a package cycle (translate -> registry ->
translate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.registry import resolve
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import read, read_file
from zerobridge.translate.report import Report, Translation
from zerobridge.translate.sources import Located

__all__ = ["load_spec", "load_spec_for_world"]

_FILE_SUFFIXES = (".json", ".hjson", ".jsonc", ".yaml", ".yml", ".toml", ".sh", ".bash", ".args", ".flags", ".txt")


def load_spec(source: str | Path | dict[str, Any] | StrategySpec, *,
              fmt: str | None = None) -> Translation[StrategySpec]:
    """The spec ``source`` means, with the report of how it was read."""
    if isinstance(source, StrategySpec):
        return Translation(source, Report(source="spec", target="spec"))
    if isinstance(source, dict):
        return read(Located(source, "<dict>"), fmt or "deepspeed")
    path = Path(source)
    if path.exists() or str(source).lower().endswith(_FILE_SUFFIXES) or "/" in str(source):
        return read_file(path, fmt)
    if fmt is not None:
        raise ConfigError(f"--from {fmt} needs a file, got the name {str(source)!r}", source=str(source))
    return resolve(str(source))


def load_spec_for_world(source: str | Path | dict[str, Any] | StrategySpec, world_size: int | None, *,
                        flag: str) -> StrategySpec:
    """The spec ``source`` means, checked against the ``world_size`` processes a launch will start
    (``flag`` sets it: ``--nproc``, ``--world-size``); ``None``: the launch cannot tell yet.

    ``compare``, ``plan`` and ``run`` all call this before any process starts. A source written for
    another world size (Accelerate's ``num_processes``) is refused, naming the file and the key: it
    fixes the batch arithmetic for that many processes, and running it on another count silently
    would change the run; ``zerobridge convert --world-size`` writes a copy for the new count and
    says what the batch becomes.

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "fsdp.yaml")
        >>> _ = open(path, "w").write("distributed_type: FSDP\\nnum_processes: 8\\nfsdp_config:\\n  fsdp_version: 2\\n")
        >>> load_spec_for_world(path, 8, flag="--nproc").sharding.world_size
        8
        >>> load_spec_for_world(path, 2, flag="--nproc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        zerobridge.errors.ConfigError: ...fsdp.yaml: num_processes: written for 8 processes; --nproc 2 starts 2
          fix: pass --nproc 8, or write a copy for 2 processes: zerobridge convert ... --world-size 2 -o COPY ...
    """
    read = load_spec(source)
    written = read.value.sharding.world_size
    if world_size is None or written is None or written == world_size:
        return read.value
    keys = [e.key for e in read.report.entries if e.target == "sharding.world_size"]
    key = next((k for k in keys if " " not in k), keys[0] if keys else "sharding.world_size")
    name = str(source) if isinstance(source, (str, Path)) else "the config"
    fsdp = any(e.key.startswith("fsdp_config") for e in read.report.entries)
    target = {"accelerate": "accelerate-fsdp" if fsdp else "accelerate-deepspeed"}  # the YAML's own kind
    raise ConfigError(f"written for {written} processes; {flag} {world_size} starts {world_size}",
                      source=name, key=key,
                      fix=f"pass {flag} {written}, or write a copy for {world_size} processes: zerobridge convert "
                          f"{name} --to {target.get(read.report.source, 'FORMAT')} --world-size {world_size} "
                          "-o COPY (it warns what the batch becomes)")
