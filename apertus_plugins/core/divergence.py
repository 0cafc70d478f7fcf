"""Say once when a run departs from the technical report's setting (a recipe or flag combination the user asked for).

The run goes on as asked; :func:`note` logs one warning per distinct setting through the logger
``apertus_plugins.report`` and returns whether it logged. The report's settings and where the code
departs from them on purpose are listed in ``docs/report-conformance.md``.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER", "note", "seen"]

#: The logger the divergences go to.
LOGGER = logging.getLogger("apertus_plugins.report")

_SEEN: set[str] = set()


def note(key: str, message: str) -> bool:
    """Log ``message`` (it should name the report's value and where the report says it) once per ``key``.

    Returns True when it was logged now, False when the same key was logged before in this process.
    """
    if key in _SEEN:
        return False
    _SEEN.add(key)
    LOGGER.warning("differs from the report: %s", message)
    return True


def seen() -> frozenset[str]:
    """The keys logged so far in this process."""
    return frozenset(_SEEN)
