"""Images and audio as token sequences: preprocessing, grid sizes and code counts, layouts."""

from . import audio, image

__all__ = ["audio", "image"]
