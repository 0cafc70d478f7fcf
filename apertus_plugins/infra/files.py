"""Reading the package's small input files with one error rule.

A JSON file that does not parse (or is not UTF-8 text) is an error of the caller's kind naming the file
and the problem, never a bare ``json.JSONDecodeError`` from deep inside a loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json"]


def read_json(path: str | os.PathLike[str], error: type[Exception] = ValueError) -> Any:
    """The parsed contents of the JSON file ``path``; raises ``error("PATH: not valid JSON (...)")`` otherwise."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from exc
