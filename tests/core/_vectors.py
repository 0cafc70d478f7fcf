"""The rendering vectors of ../shared/vectors (or $APERTUS_SHARED/vectors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

SHARED = Path(os.environ.get("APERTUS_SHARED", Path(__file__).resolve().parents[3] / "shared"))
VECTORS_PATH = SHARED / "vectors" / "chat_render.json"
if not VECTORS_PATH.is_file():
    raise FileNotFoundError(f"rendering vectors not found at {VECTORS_PATH}: put shared/ beside the clone "
                            "or set APERTUS_SHARED")
VECTORS = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
