"""The rendering vectors of the core suite, all shipped in the repository.

- ``VECTORS``: the project's 8 shared rendering vectors, from the copy the package ships
  (``apertus_plugins/doctor/chat_render.json``; the doctor compares checkpoints against it). Where
  the project's ``shared/`` folder stands beside the clone (or ``$APERTUS_SHARED`` names it),
  ``test_doctor_core`` checks that the copy is byte-identical to it.
- ``CANONICAL``: renders of the released Apertus 1.5 chat template over seeded generated
  conversations (``tests/core/data/chat_canonical.json``, made by ``tools/chat_vectors.py``):
  ``RENDERED`` hold the expected string, ``REJECTED`` inputs the released template refuses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_VECTORS_PATH = ROOT / "apertus_plugins" / "doctor" / "chat_render.json"
VECTORS = json.loads(PACKAGE_VECTORS_PATH.read_text(encoding="utf-8"))
SHARED_VECTORS_PATH = Path(os.environ.get("APERTUS_SHARED", ROOT.parent / "shared")) / "vectors" / "chat_render.json"

CANONICAL_PATH = Path(__file__).resolve().parent / "data" / "chat_canonical.json"
CANONICAL_DOC = json.loads(CANONICAL_PATH.read_text(encoding="utf-8"))
CANONICAL = CANONICAL_DOC["vectors"]
RENDERED = [v for v in CANONICAL if "rendered" in v]
REJECTED = [v for v in CANONICAL if "raises" in v]


def kwargs_of(vec: dict) -> dict:
    """``render()`` keyword arguments of a vector (its input and its variant)."""
    return {**vec["input"], "variant": vec.get("variant", "inference")}
