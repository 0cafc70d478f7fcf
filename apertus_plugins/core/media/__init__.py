"""Images and audio as token sequences: preprocessing, grid sizes and code counts, layouts, limits."""

from . import audio, image, limits

__all__ = ["audio", "image", "limits"]
