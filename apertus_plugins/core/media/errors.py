"""The errors of media handling: every refusal of an image or a clip is one of these (``ValueError``s).

They live apart from :mod:`.image` and :mod:`.audio` (which re-export them) so that :mod:`.limits`,
which both use, raises them without importing either.
"""

from __future__ import annotations

__all__ = ["MediaError", "ImageError", "AudioError"]


class MediaError(ValueError):
    """A media item that cannot be turned into a token sequence; the message names it."""


class ImageError(MediaError):
    """An image that cannot be turned into a token sequence; the message names it."""


class AudioError(MediaError):
    """Audio that cannot be turned into a token sequence; the message names it."""
