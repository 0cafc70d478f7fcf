"""Media limits: what an image or an audio clip may cost before any expensive work is done.

Every caller that turns media into pixels or samples (the vLLM processor, ``apertus encode``,
``apertus tokenize``, the evaluation models, the demo, the doctor) goes through
:mod:`apertus_plugins.core.media.image` and :mod:`apertus_plugins.core.media.audio`, which apply these checks
themselves; a caller only chooses the :class:`MediaLimits` (the defaults below, or its own).

Images. The size is read from the file's header before a pixel is decoded. An image above
``max_image_pixels`` is refused. One above ``reduce_above_pixels`` is first reduced cheaply (the
JPEG decoder's draft mode, then Pillow's ``Image.reduce`` box filter by an integer factor), to no
less than twice the post-resize size per side, and only then resized exactly; the code grid is
always computed from the ORIGINAL size (as the offline planner computes it from headers), so a
pre-reduced image has the same grid and the same sequence length, and only its pixels may differ
slightly from the released processor's. Images at or below ``reduce_above_pixels`` are bit-exact
with the released processor. So the exact resize never reads more than
``max(reduce_above_pixels, 9 * 1400 * 1400)`` pixels, whatever the input.

Audio. The header numbers (frames, sample rate, channels) are checked before decoding when there
is a header, and again on the decoded array; the samples are checked finite and within
``max_abs_sample`` before the downmix and the resampling, so nothing downstream can overflow or
carry a NaN. A clip longer than ``max_audio_seconds`` (frames over sample rate) is refused from those
numbers, before any resampling work (a low sample rate cannot make a small file huge).

Every refusal is an :class:`~apertus_plugins.core.media.image.ImageError` or an
:class:`~apertus_plugins.core.media.audio.AudioError` (both ``ValueError``) naming the item and the limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .errors import AudioError, ImageError

__all__ = ["MediaLimits", "DEFAULT_LIMITS", "check_image_size", "prereduce_factor", "check_audio_header",
           "check_audio_samples"]


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one media item; the defaults are documented field by field.

    Attributes:
        max_image_pixels: the largest image (width x height, read from the header) accepted:
            8192 x 8192 = 67,108,864 pixels (about 200 MB of RGB once decoded). The released
            processor resizes everything to at most 1400 x 1400 anyway.
        reduce_above_pixels: above this many pixels an image is pre-reduced cheaply (decoder draft
            mode, ``Image.reduce``) before the exact resize: 16,000,000 (e.g. 4000 x 4000; above
            the 12-megapixel photos of common phones, which stay bit-exact with the released
            processor).
        max_audio_seconds: the longest clip accepted, frames over sample rate: 3600 s
            (144,000 codes). A server lowers it with its ``max_audio_seconds`` option (60 s).
        min_sample_rate, max_sample_rate: the accepted range of input sample rates, 1,000 to
            384,000 Hz (below it a header can make a small file resample into a huge one; above it
            the polyphase filter grows with the rate).
        max_channels: the most audio channels accepted (64).
        max_abs_sample: the largest finite absolute sample value accepted: 2**24 = 16,777,216
            (twice the largest 24-bit PCM value, for float files that hold unnormalized integer
            samples); far enough below the float32 limit (3.4e38) that no downmix or resampling
            can overflow. Non-finite samples (NaN, +-inf) are always refused.
    """

    max_image_pixels: int = 8192 * 8192
    reduce_above_pixels: int = 16_000_000
    max_audio_seconds: float = 3600.0
    min_sample_rate: int = 1_000
    max_sample_rate: int = 384_000
    max_channels: int = 64
    max_abs_sample: float = float(2**24)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"media limit {f.name} must be a positive finite number, got {v!r}")
        if self.min_sample_rate > self.max_sample_rate:
            raise ValueError(f"media limits: min_sample_rate {self.min_sample_rate} is above max_sample_rate "
                             f"{self.max_sample_rate}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names (the field names), e.g. for a server's ``--mm-processor-kwargs``."""
        return tuple(f.name for f in fields(cls))

    def updated(self, options: Mapping[str, Any]) -> MediaLimits:
        """A copy with the limits named in ``options`` replaced (other keys are ignored); validated."""
        given = {k: v for k, v in options.items() if k in self.names()}
        return replace(self, **given) if given else self


#: The limits every function uses when it is given none.
DEFAULT_LIMITS = MediaLimits()


def _limits(limits: MediaLimits | None) -> MediaLimits:
    return DEFAULT_LIMITS if limits is None else limits


# ---------------------------------------------------------------------- images
def check_image_size(height: int, width: int, limits: MediaLimits | None = None, name: str = "image") -> None:
    """Refuse an image whose header size is above ``max_image_pixels`` (``ImageError`` naming it)."""
    lim = _limits(limits)
    pixels = int(height) * int(width)
    if pixels > lim.max_image_pixels:
        raise ImageError(f"{name}: {width}x{height} is {pixels:,} pixels, above the {lim.max_image_pixels:,} "
                         f"accepted (media limit max_image_pixels); scale it down before sending it")


def prereduce_factor(height: int, width: int, target: tuple[int, int], limits: MediaLimits | None = None) -> int:
    """The integer factor an image of this size is reduced by before its exact resize to ``target``.

    1 (no reduction) at or below ``reduce_above_pixels``; above it the largest factor that keeps
    at least twice the target size per side (so the exact antialiased resize still averages over
    at least two source pixels per output pixel in each direction).
    """
    lim = _limits(limits)
    if int(height) * int(width) <= lim.reduce_above_pixels:
        return 1
    th, tw = target
    return max(1, min(int(height) // (2 * int(th)), int(width) // (2 * int(tw))))


# ---------------------------------------------------------------------- audio
def check_audio_header(frames: int, sample_rate: float, channels: int = 1, limits: MediaLimits | None = None,
                       name: str = "audio", max_seconds: float | None = None) -> None:
    """Refuse a clip from its header numbers alone: no samples, a sample rate out of range, too many
    channels, or longer than ``max_audio_seconds`` (or ``max_seconds`` when smaller): ``frames / rate`` seconds.
    Raises ``AudioError`` naming the clip and the limit."""
    lim = _limits(limits)
    frames, channels = int(frames), int(channels)
    if frames <= 0:
        raise AudioError(f"{name}: the audio has no samples")
    if not isinstance(sample_rate, (int, float, np.integer, np.floating)) or not math.isfinite(sample_rate) or \
            sample_rate != int(sample_rate):
        raise AudioError(f"{name}: invalid sample rate {sample_rate!r} (a whole number of Hz)")
    rate = int(sample_rate)
    if not lim.min_sample_rate <= rate <= lim.max_sample_rate:
        raise AudioError(f"{name}: sample rate {rate:,} Hz is outside the accepted {lim.min_sample_rate:,} to "
                         f"{lim.max_sample_rate:,} Hz (media limits min_sample_rate, max_sample_rate)")
    if channels <= 0 or channels > lim.max_channels:
        raise AudioError(f"{name}: {channels} channels; between 1 and {lim.max_channels} are accepted "
                         "(media limit max_channels)")
    limit = lim.max_audio_seconds if max_seconds is None else min(lim.max_audio_seconds, float(max_seconds))
    if frames > limit * rate:  # the duration, from the two numbers
        raise AudioError(f"{name}: {frames:,} samples at {rate:,} Hz are {frames / rate:,.1f} s, longer than the "
                         f"{limit:g} s accepted (media limit max_audio_seconds)")


def check_audio_samples(wave: np.ndarray, limits: MediaLimits | None = None, name: str = "audio") -> None:
    """Refuse non-finite samples and samples beyond ``max_abs_sample`` (``AudioError`` naming the first)."""
    lim = _limits(limits)
    x = np.asarray(wave)
    if x.size == 0:
        raise AudioError(f"{name}: the audio has no samples")
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise AudioError(f"{name}: samples must be numbers, got dtype {x.dtype}")
    flat = x.reshape(-1)
    if np.issubdtype(x.dtype, np.floating):
        bad = ~np.isfinite(flat)
        with np.errstate(invalid="ignore"):
            big = np.abs(flat) > lim.max_abs_sample  # NaN compares False; |finite| stays finite
    else:
        bad = np.zeros(flat.shape, dtype=bool)
        big = np.abs(flat.astype(np.float64)) > lim.max_abs_sample
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise AudioError(f"{name}: {int(bad.sum()):,} non-finite sample(s) (the first, {float(flat[k])}, at index {k}); "
                         "audio samples must be finite numbers")
    if big.any():
        k = int(np.flatnonzero(big)[0])
        raise AudioError(f"{name}: {int(big.sum()):,} sample(s) beyond +-{lim.max_abs_sample:g} (the first, "
                         f"{float(flat[k]):g}, at index {k}; media limit max_abs_sample)")
