"""Reading and writing the package's small files with one rule each.

A JSON file that does not parse (or is not UTF-8 text) is an error of the caller's kind naming the file
and the problem, never a bare ``json.JSONDecodeError`` from deep inside a loader. A file is written
whole or not at all: to a temporary file beside it, flushed to disk, then renamed into place, so a
crash leaves the old file (or none), never a truncated one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_text_atomic"]


def read_json(path: str | os.PathLike[str], error: type[Exception] = ValueError) -> Any:
    """The parsed contents of the JSON file ``path``; raises ``error("PATH: not valid JSON (...)")`` otherwise."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from exc


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; creates the parent folder; returns the path.

    Concurrent writers of one path each rename a complete file of their own into place: the last
    rename wins and a reader never sees a mixture.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
