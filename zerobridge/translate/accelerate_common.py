"""What the Accelerate reader (``accelerate_read``), its FSDP-plugin reader
(``accelerate_fsdp``) and the writers (``accelerate_write``) share: the format
name, key prefixes, the launcher's spelling of keys, and running a delegate
reader on the kwargs Accelerate builds.

    >>> from zerobridge.translate.accelerate_common import F, launcher_prefix
    >>> launcher_prefix("fsdp_config", "sharding_strategy"), F + "fsdp_version"
    ('fsdp_sharding_strategy', 'fsdp_config.fsdp_version')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import StrategySpec
from zerobridge.translate.keys import SourceKeys
from zerobridge.translate.report import Status, Translation
from zerobridge.translate.sources import Located

__all__ = ["D", "F", "FORMAT", "P", "call_reader", "carry_machines", "launcher_prefix"]

FORMAT = "accelerate"
"""The format name: the mapping table, the report's source and the passthrough key."""
F = "fsdp_config."
P = "parallelism_config.parallelism_config_"
D = "deepspeed_config."

_PREFIXES = {"fsdp_config": "fsdp_", "dynamo_config": "dynamo_"}


def launcher_prefix(prefix: str, key: str) -> str:
    """``key`` of section ``prefix`` as the launcher names it: it copies ``fsdp_config``
    and ``dynamo_config`` keys to ``--fsdp_*`` / ``--dynamo_*`` arguments, adding the
    prefix when missing."""
    head = _PREFIXES.get(prefix)
    return key if head is None or key.startswith(head) else head + key


def call_reader(located: Located, reader: Callable[[Located], Translation[StrategySpec]], data: dict[str, Any],
                label: str, key: str) -> Translation[StrategySpec]:
    """Run a delegate reader on built kwargs; its errors point at the YAML key they came from."""
    try:
        return reader(Located(data, f"{located.source} ({label})"))
    except ConfigError as exc:
        raise located.error(f"{exc.message} (in the {label} Accelerate builds from it)", key=key,
                            fix=exc.fix) from None


def carry_machines(keys: SourceKeys, why: str) -> None:
    """Report ``num_machines`` as not about sharding (``why``) and carry it verbatim."""
    keys.note("num_machines", Status.NOT_ABOUT_SHARDING, why)
    if keys.given("num_machines"):
        keys.carried["num_machines"] = keys.values["num_machines"]
