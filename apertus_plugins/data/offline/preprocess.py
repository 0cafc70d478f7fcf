"""A run's media settings, and the core's media functions called with them (the pipeline's one seam to the core).

Planning checks each header against the limits (:meth:`MediaSettings.check_image`,
:meth:`MediaSettings.check_audio`) and reads a shape from it (:meth:`MediaSettings.image_size`,
:meth:`MediaSettings.audio_length`); workers decode and preprocess the bytes
(:meth:`MediaSettings.image`, :meth:`MediaSettings.audio`). Every call of the pipeline into
:mod:`apertus_plugins.core.media` goes through this class, and :meth:`TokenizeConfig.media_settings
<apertus_plugins.data.offline.config.TokenizeConfig.media_settings>` is the one place a run's
settings become a :class:`MediaSettings`: a new setting of the core (a limit, a policy) is a
field here, passed on in these four methods, and a line there.

Errors are the core's (:class:`~apertus_plugins.core.media.image.ImageError`,
:class:`~apertus_plugins.core.media.audio.AudioError`, ``OSError``); the callers turn them into a
skipped item with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apertus_plugins.core.media.limits import DEFAULT_LIMITS, MediaLimits, check_audio_header, check_image_size

__all__ = ["MediaSettings"]


@dataclass(frozen=True)
class MediaSettings:
    """The core's named preprocessing policies a run uses (``--resize-policy``, ``--audio-policy``) and
    the core's media limits (``--media-limit NAME=VALUE``): an item above a limit is refused from its
    header at planning, before any pixel or sample is decoded, and skipped with its reason."""

    resize_policy: str = "released"
    audio_policy: str = "released"
    limits: MediaLimits = field(default=DEFAULT_LIMITS)

    # ------------------------------------------------------------------ from headers (planning)
    def check_image(self, height: int, width: int, name: str) -> None:
        """Refuse an image above the limits from its header size (an ``ImageError`` naming it)."""
        check_image_size(height, width, self.limits, name)

    def check_audio(self, frames: int, rate: int, channels: int, name: str) -> None:
        """Refuse a clip above the limits from its header numbers (an ``AudioError`` naming it)."""
        check_audio_header(frames, rate, channels, self.limits, name)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """The size an image of ``height x width`` (EXIF-transposed) has after preprocessing."""
        from apertus_plugins.core.media.image import resized_size

        return resized_size(height, width, self.resize_policy)

    def audio_length(self, frames: int, rate: int) -> int:
        """The samples at 24 kHz a clip of ``frames`` frames at ``rate`` Hz has after preprocessing."""
        from apertus_plugins.core.media.audio import resampled_length

        return resampled_length(frames, rate, self.audio_policy)

    # ------------------------------------------------------------------ from bytes (workers)
    def image(self, data: bytes) -> Any:
        """Float32 ``[3, H, W]`` pixels of an image file's bytes."""
        from apertus_plugins.core.media.image import preprocess_image

        return preprocess_image(data, self.resize_policy, limits=self.limits).pixels

    def audio(self, data: bytes) -> Any:
        """Float32 samples at 24 kHz of an audio file's bytes."""
        from apertus_plugins.core.media.audio import load_audio, preprocess_audio

        wave, rate = load_audio(data, limits=self.limits)
        return preprocess_audio(wave, rate, self.audio_policy, limits=self.limits)
