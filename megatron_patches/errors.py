"""The adapter's error types (no Megatron import), so the launcher can report them without a traceback."""

from __future__ import annotations

__all__ = ["ApertusRunError", "ApertusArgumentError", "PreflightError", "SftPackingError"]


class ApertusRunError(ValueError):
    """A run the plugin refuses to start; the message names the input and the problem."""


class ApertusArgumentError(ApertusRunError):
    """A bad ``--apertus-*`` argument."""


class PreflightError(ApertusRunError):
    """Data, manifest or vocabulary that does not fit the run, found before training starts."""


class SftPackingError(ApertusRunError):
    """An SFT prefix that cannot be packed (a conversation longer than a sample, a bad mask stream)."""
