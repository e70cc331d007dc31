"""Every JSON file lmforge reads from a user (model configs, weight indexes, tokenizer
configs, manifests, DeepSpeed configs, checkpoint records) is read through here and
checked for its shape: a file that is not what it should be is one ValueError
naming it, which callers turn into their one-line error, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_object(text: str | bytes, where: str) -> dict:
    """`text` as a JSON object; ValueError naming `where` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be read") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON (line {err.lineno}: {err.msg})") from None
    except ValueError:  # bytes that are not UTF-8
        raise ValueError(f"{where}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: holds a JSON {_kind(value)}, where an object belongs")
    return value


def read_object(path: str | Path) -> dict:
    """The JSON object in a file; ValueError naming the file otherwise."""
    try:
        text = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{path}: unreadable ({err.strerror or err})") from None
    return parse_object(text, str(path))


def member(obj: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """`obj[key]`, which must be a `kind`; ValueError naming the file and the key."""
    if key not in obj:
        if default is not ...:
            return default
        raise ValueError(f"{where}: `{key}` is missing")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ValueError(f"{where}: `{key}` is a JSON {_kind(value)}, where {_article(kind)} belongs")
    return value


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(
        type(value), "value"
    )


def _article(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {dict: "an object", list: "a list", str: "a string", int: "a whole number", float: "a number", bool: "a boolean", type(None): "null"}.get(
            k, k.__name__
        )
        for k in kinds
    )
