"""Reading config files the way their consumers read them, with positions.

DeepSpeed parses its config with hjson (comments, trailing commas, unquoted
keys) and rejects duplicate keys; Accelerate reads YAML; torchtitan TOML. Every
parse error becomes a ``ConfigError`` with file, line and column. ``Located``
keeps the text so later errors can name the line of a key. A file with nothing
in it (whitespace only, or a ``null`` document) is refused: it is almost
always a write that failed, not a wish for every default. JSON that only hjson
accepts is read, as DeepSpeed reads it, and ``Located.lenient`` says where it
leaves JSON: Hugging Face Trainer and Accelerate load DeepSpeed configs with
``json`` and reject such a file.

    >>> parse_json('{"zero_optimization": {"stage": 2}\\n "bf16": {"enabled": true}}', "ds.json").lenient
    "line 2, column 2: not strict JSON (Expecting ',' delimiter)"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hjson
import tomllib
import yaml

from zerobridge.errors import ConfigError
from zerobridge.translate.report import Report, Status

__all__ = ["Located", "note_lenient", "parse_json", "parse_toml", "parse_yaml", "read_text"]


@dataclass
class Located:
    """Parsed data plus where it came from, to point at keys by line."""

    data: Any
    source: str
    text: str = ""
    lines: dict[str, int] = field(default_factory=dict)
    """Line (1-based) of each dotted key path, where the parser knows it."""
    lenient: str | None = None
    """Where the text first leaves strict JSON (hjson syntax), when it does."""

    def line_of(self, key: str) -> int | None:
        """The line of ``key`` (or of its nearest known parent)."""
        if key in self.lines:
            return self.lines[key]
        if self.text and key:
            return _scan_json_line(self.text, key.split("."))
        return None

    def error(self, message: str, *, key: str | None = None, fix: str | None = None) -> ConfigError:
        """A ``ConfigError`` pointing at ``key`` in this source."""
        return ConfigError(message, source=self.source, key=key,
                           line=self.line_of(key) if key else None, fix=fix)


def read_text(path: str | Path) -> str:
    """The file's text, or a ``ConfigError`` saying why it cannot be read."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", source=p,
                          fix="check the path, or give a registry name (see `zerobridge strategies`)") from None
    except IsADirectoryError:
        raise ConfigError("is a directory, expected a config file", source=p) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", source=p) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=p) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key




def _empty(source: str) -> ConfigError:
    return ConfigError(f"{source} is empty", fix="it holds no settings (only whitespace, or a null document), "
                                                 "which is almost always a write that failed: write the config "
                                                 "again, or name the file you meant")


def parse_json(text: str, source: str) -> Located:
    """Parse DeepSpeed-style JSON: hjson syntax, duplicate keys rejected."""
    if not text.strip():
        raise _empty(source)
    lenient = None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise _duplicate_error(text, source, exc.key) from None
    except json.JSONDecodeError as strict_error:
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except _DuplicateKey as exc:
            raise _duplicate_error(text, source, exc.key) from None
        except hjson.HjsonDecodeError as exc:
            line = getattr(exc, "lineno", None) or strict_error.lineno
            col = getattr(exc, "colno", None) or strict_error.colno
            raise ConfigError(f"not valid JSON/HJSON: {exc.msg if hasattr(exc, 'msg') else exc}",
                              source=source, line=line, column=col,
                              fix="fix the syntax at that position") from None
        data = _plain(data)
        lenient = f"line {strict_error.lineno}, column {strict_error.colno}: not strict JSON ({strict_error.msg})"
    if data is None:
        raise _empty(source)
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object at the top, found {type(data).__name__}",
                          source=source, line=1, fix="wrap the settings in { ... }")
    return Located(data=data, source=source, text=text, lenient=lenient)


def _plain(value: Any) -> Any:
    """hjson returns OrderedDicts; make plain dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _duplicate_error(text: str, source: str, key: str) -> ConfigError:
    needle = f'"{key}"'
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    line = lines[1] if len(lines) > 1 else (lines[0] if lines else None)
    return ConfigError(f"duplicate key {key!r} (DeepSpeed rejects configs with repeated keys)",
                       source=source, key=key, line=line, fix="keep one of the two entries")


def _scan_json_line(text: str, parts: list[str]) -> int | None:
    """Line of a nested key found by scanning for each part in order."""
    pos = 0
    found = None
    for part in parts:
        for quote in ('"', "'", ""):
            needle = f"{quote}{part}{quote}" if quote else part
            i = text.find(needle, pos)
            if i >= 0:
                pos = i + len(needle)
                found = text.count("\n", 0, i) + 1
                break
        else:
            return found
    return found


class _LineLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys and records key lines."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise ConfigError(f"duplicate key {key!r}", line=key_node.start_mark.line + 1,
                              key=str(key), fix="keep one of the two entries")
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _yaml_lines(value_node, path, out)


def parse_yaml(text: str, source: str) -> Located:
    """Parse YAML safely: duplicate keys rejected, key lines recorded."""
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        data = yaml.load(text, Loader=_LineLoader)
    except ConfigError as exc:
        raise exc.located(source=source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise ConfigError(f"not valid YAML: {exc.problem}", source=source,
                          line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None,
                          fix="fix the syntax at that position") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=source) from None
    if data is None:
        raise _empty(source)
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top, found {type(data).__name__}", source=source, line=1)
    lines: dict[str, int] = {}
    if node is not None:
        _yaml_lines(node, "", lines)
    return Located(data=data, source=source, text="", lines=lines)


def parse_toml(text: str, source: str) -> Located:
    """Parse TOML (torchtitan configs, zerobridge strategy files)."""
    if not text.strip():
        raise _empty(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = col = None
        # tomllib puts "(at line L, column C)" at the end of its message.
        if "(at line " in message:
            tail = message.rsplit("(at line ", 1)[1].rstrip(")")
            message = message.rsplit(" (at line ", 1)[0]
            try:
                line_s, col_s = tail.split(", column ")
                line, col = int(line_s), int(col_s)
            except ValueError:
                pass
        raise ConfigError(f"not valid TOML: {message}", source=source, line=line, column=col,
                          fix="fix the syntax at that position") from None
    return Located(data=data, source=source, text=text)


def note_lenient(located: Located, report: Report) -> None:
    """Warn (in ``report``) where ``located`` leaves strict JSON."""
    if located.lenient is not None:
        report.add(located.source, Status.SYNTAX,
                   f"{located.lenient}: DeepSpeed reads it (hjson), but Hugging Face Trainer and Accelerate "
                   "read DeepSpeed configs with json and refuse it; quote the keys, add the missing commas and "
                   "drop comments and trailing commas")
