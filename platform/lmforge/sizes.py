"""Byte sizes as people write them: 80GB, 141GiB, 512MiB, or a plain number of bytes."""

from __future__ import annotations

import re

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes; ValueError (saying what was wrong) for anything else or for zero."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", str(text).strip())
        if not match or match.group(2).upper() not in UNITS:
            raise ValueError(f"{text!r} is not a size such as 80GB or 141GiB")
        size = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"must be above 0, got {text!r}")
    return size
