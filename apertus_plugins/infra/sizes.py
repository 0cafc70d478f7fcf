"""Byte sizes as people write them on command lines (``--plan-bytes 64MB``, ``--shard-size 400KB``)."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str | int | None) -> int | None:
    """``"50MB"``, ``"2GB"``, ``"500KB"``, ``"1000"`` or an int -> bytes (``None`` stays ``None``); binary units."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read the size {text!r} (examples: 500KB, 50MB, 2GB)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _UNITS[unit])
