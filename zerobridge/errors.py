"""User-facing errors: what was wrong, where, and how to fix it.

Every error a user can cause is a ``ConfigError``. The CLI prints its message
and exits 2; nothing else escapes as a traceback. This module is the bottom
layer and imports nothing from zerobridge: turning a spec validation error into
a ``ConfigError`` needs the spec's union tags, so ``from_validation_error``
lives in ``zerobridge.translate.keys``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ConfigError", "closest"]


class ConfigError(ValueError):
    """A bad config: names the file, the key path, the line when known, what
    was expected and the fix."""

    def __init__(
        self,
        message: str,
        *,
        source: str | Path | None = None,
        key: str | None = None,
        line: int | None = None,
        column: int | None = None,
        fix: str | None = None,
    ) -> None:
        self.message = message
        self.source = str(source) if source is not None else None
        self.key = key
        self.line = line
        self.column = column
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        """``file:line:col: key: message. Fix: ...``"""
        where = ""
        if self.source:
            where = self.source
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
        head = ": ".join(part for part in (where, self.key) if part)
        text = f"{head}: {self.message}" if head else self.message
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text

    def located(self, *, source: str | Path | None = None, line: int | None = None,
                key_prefix: str | None = None) -> ConfigError:
        """A copy with the file, line or an outer key prefix filled in."""
        key = self.key
        if key_prefix:
            key = f"{key_prefix}.{key}" if key else key_prefix
        return ConfigError(
            self.message,
            source=self.source or source,
            key=key,
            line=self.line if self.line is not None else line,
            column=self.column,
            fix=self.fix,
        )


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The most similar of ``choices``, or None when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None
