"""Audio as token sequences (SPEC.md 2.2): loading, 24 kHz mono at -3 dBFS, code counts, layouts.

WavTokenizer emits one code per 600 samples at 24 kHz (40 codes per second), so a clip of n
samples costs ceil(n / 600) codes. The sequence of a clip is ``<|audio_start|>`` + codes +
``<|audio_end|>``; the training modes add the task markers.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ..vocab import VocabSpec
from .errors import AudioError
from .limits import MediaLimits, check_audio_header, check_audio_samples

__all__ = [
    "SAMPLE_RATE", "HOP", "TARGET_PEAK_DBFS", "AudioError", "AudioPolicy", "AUDIO_POLICIES", "RESAMPLERS",
    "RESAMPLED_LENGTHS",
    "load_audio", "peak_normalize", "mono_24k", "normalize_audio", "preprocess_audio", "resampled_length", "audio_code_count",
    "audio_sequence", "audio_placeholder_sequence", "transcription_sequence", "interleaved_sequences",
    "PADDED_DROP_CODES", "padded_code_counts",
]

SAMPLE_RATE = 24_000
HOP = 600
TARGET_PEAK_DBFS = -3.0


def load_audio(source: str | Path | bytes, always_2d: bool = True,
               limits: MediaLimits | None = None) -> tuple[np.ndarray, int]:
    """Decode a file (or its bytes) with soundfile, after checking its header against ``limits``.

    Returns:
        ``(waveform, sample_rate)``: float32 ``[channels, samples]`` (``[samples]`` for a mono file
        when ``always_2d`` is False).

    Raises:
        FileNotFoundError: no such file. AudioError: not audio, a format libsndfile cannot read,
        no samples, or a header beyond ``limits`` (length, sample rate, channels), checked before
        anything is decoded; the message names the file.
    """
    import soundfile as sf

    is_bytes = isinstance(source, (bytes, bytearray, memoryview))
    name = f"<{len(source)} bytes>" if is_bytes else str(source)
    if not is_bytes and not Path(source).is_file():
        raise FileNotFoundError(f"{name}: no such audio file")
    if (len(source) if is_bytes else Path(source).stat().st_size) == 0:
        raise AudioError(f"{name}: the file is empty (zero bytes)")
    try:
        with sf.SoundFile(io.BytesIO(bytes(source)) if is_bytes else str(source)) as fh:
            check_audio_header(fh.frames, fh.samplerate, fh.channels, limits, name)
            data = fh.read(dtype="float32", always_2d=True)
            rate = fh.samplerate
    except AudioError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever libsndfile raises on a malformed file is bad input
        raise AudioError(f"{name}: not a readable audio file or an unsupported format ({exc})") from exc
    if data.shape[0] == 0:
        raise AudioError(f"{name}: the audio has no samples")
    wave = np.ascontiguousarray(data.T)
    if not always_2d and wave.shape[0] == 1:
        wave = wave[0]
    return wave, int(rate)


def _resample_poly(x: np.ndarray, rate: int) -> np.ndarray:
    from scipy.signal import resample_poly

    ratio = Fraction(SAMPLE_RATE, rate)  # reduced up/down
    return resample_poly(x, ratio.numerator, ratio.denominator).astype(np.float32)


def _resample_fft(x: np.ndarray, rate: int) -> np.ndarray:
    from scipy.signal import resample

    n = int(round(x.size * SAMPLE_RATE / rate))
    return resample(x, max(n, 1)).astype(np.float32)


#: Resampling methods by name: ``(mono float32, sample_rate) -> float32 at 24 kHz``.
RESAMPLERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "poly": _resample_poly,
    "fft": _resample_fft,
}


def _poly_length(n: int, rate: int) -> int:
    ratio = Fraction(SAMPLE_RATE, rate)
    return -(-n * ratio.numerator // ratio.denominator)  # scipy's resample_poly: ceil(n * up / down)


def _fft_length(n: int, rate: int) -> int:
    return max(int(round(n * SAMPLE_RATE / rate)), 1)


#: Output length of each resampler: ``(samples, sample_rate) -> samples at 24 kHz``.
RESAMPLED_LENGTHS: dict[str, Callable[[int, int], int]] = {
    "poly": _poly_length,
    "fft": _fft_length,
}


@dataclass(frozen=True)
class AudioPolicy:
    """Audio preprocessing settings: the resampler, the downmix and the peak level (``None``: no normalization)."""

    name: str
    resampler: str = "poly"
    downmix: str = "mean"
    target_peak_dbfs: float | None = TARGET_PEAK_DBFS


#: Named audio policies. ``released``: mean downmix, polyphase resampling with the reduced ratio,
#: peak-normalized to -3 dBFS exactly as ``WavTokenizerFeatureExtractor(normalize_audio=True)``.
AUDIO_POLICIES: dict[str, AudioPolicy] = {
    "released": AudioPolicy("released"),
    "fft": AudioPolicy("fft", resampler="fft"),
    "raw": AudioPolicy("raw", target_peak_dbfs=None),
}


def _audio_policy(policy: str | AudioPolicy) -> AudioPolicy:
    if isinstance(policy, AudioPolicy):
        return policy
    try:
        return AUDIO_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown audio policy {policy!r}; policies are {', '.join(AUDIO_POLICIES)}") from None


def peak_normalize(x: np.ndarray, target_dbfs: float = TARGET_PEAK_DBFS) -> np.ndarray:
    """``x * (10 ** (target / 20) / max(max|x|, 1e-10))``, the factor in float64 applied in float32.

    The operation order of the released feature extractor, so the result is identical.
    """
    x = np.asarray(x, dtype=np.float32)
    target = 10.0 ** (target_dbfs / 20.0)
    return x * (target / max(float(np.abs(x).max()), 1e-10))


def mono_24k(waveform: Any, sample_rate: int, policy: str | AudioPolicy = "released",
             limits: MediaLimits | None = None, name: str = "audio") -> np.ndarray:
    """Check, downmix to mono and resample to 24 kHz: float32 ``[samples]``, not yet normalized.

    The checks come first (:mod:`apertus_plugins.core.media.limits`): the length, rate and channel
    count from the numbers alone, then every sample finite and within ``limits.max_abs_sample``,
    so neither the downmix nor the resampling can overflow or carry a NaN. A mono clip already at
    24 kHz comes back unchanged (the same float32 values): applying this twice is applying it once.

    Raises:
        AudioError: naming ``name`` and the problem.
    """
    p = _audio_policy(policy)
    try:
        x = np.asarray(waveform)
    except Exception as exc:  # noqa: BLE001 - ragged lists and the like
        raise AudioError(f"{name}: not an array of samples ({exc})") from exc
    if x.ndim not in (1, 2):
        raise AudioError(f"{name}: audio must be [samples] or [channels, samples], got shape {x.shape}")
    if not isinstance(sample_rate, (int, float, np.integer, np.floating)) or isinstance(sample_rate, bool):
        raise AudioError(f"{name}: invalid sample rate {sample_rate!r}")
    channels, frames = (1, x.shape[0]) if x.ndim == 1 else x.shape
    check_audio_header(frames, sample_rate, channels, limits, name)
    check_audio_samples(x, limits, name)
    x = x.astype(np.float32, copy=False)
    if x.ndim == 2:
        if p.downmix != "mean":
            raise ValueError(f"unknown downmix {p.downmix!r}; the only downmix is 'mean'")
        x = x.mean(axis=0, dtype=np.float32)
    rate = int(sample_rate)
    if rate != SAMPLE_RATE:
        try:
            resample = RESAMPLERS[p.resampler]
        except KeyError:
            raise ValueError(f"unknown resampler {p.resampler!r}; resamplers are {', '.join(RESAMPLERS)}") from None
        x = resample(x, rate)
    return np.ascontiguousarray(x, dtype=np.float32)


def normalize_audio(x: np.ndarray, policy: str | AudioPolicy = "released") -> np.ndarray:
    """The policy's level normalization of a :func:`mono_24k` clip (peak to -3 dBFS for ``released``)."""
    p = _audio_policy(policy)
    if p.target_peak_dbfs is None:
        return np.ascontiguousarray(x, dtype=np.float32)
    return np.ascontiguousarray(peak_normalize(x, p.target_peak_dbfs), dtype=np.float32)


def preprocess_audio(waveform: Any, sample_rate: int, policy: str | AudioPolicy = "released",
                     limits: MediaLimits | None = None, name: str = "audio") -> np.ndarray:
    """Downmix to mono, resample to 24 kHz and peak-normalize: float32 ``[samples]`` at 24 kHz.

    Args:
        waveform: ``[samples]`` or ``[channels, samples]`` (as :func:`load_audio` returns it).
        sample_rate: its rate in Hz.
        policy: a name in :data:`AUDIO_POLICIES` or an :class:`AudioPolicy`.
        limits: a :class:`~apertus_plugins.core.media.limits.MediaLimits` (default: its defaults),
            checked before any work (see :func:`mono_24k`).
        name: how error messages name the clip.

    Raises:
        AudioError: non-finite samples, samples beyond ``limits.max_abs_sample``, no samples, a
            sample rate, channel count or length beyond ``limits``; the message names the clip.
    """
    return normalize_audio(mono_24k(waveform, sample_rate, policy, limits, name), policy)


def resampled_length(num_samples: int, sample_rate: int, policy: str | AudioPolicy = "released") -> int:
    """Samples of :func:`preprocess_audio`'s output for a clip of ``num_samples`` frames at ``sample_rate``.

    Computed from the two numbers alone (a file header is enough), so a planner can group clips of
    identical length without decoding them.
    """
    p = _audio_policy(policy)
    n, rate = int(num_samples), int(sample_rate)
    if n <= 0:
        raise AudioError("the audio has no samples")
    if rate <= 0:
        raise AudioError(f"invalid sample rate {rate}")
    if rate == SAMPLE_RATE:
        return n
    try:
        length = RESAMPLED_LENGTHS[p.resampler]
    except KeyError:
        raise ValueError(f"unknown resampler {p.resampler!r}; resamplers are {', '.join(RESAMPLED_LENGTHS)}") from None
    return length(n, rate)


def audio_code_count(num_samples: int) -> int:
    """Codes for a 24 kHz clip of ``num_samples`` samples: ceil(samples / 600)."""
    return -(-int(num_samples) // HOP)


#: Codes dropped from the end of a clip that was padded in a batch (report 2.3.2: "the last few codes
#: before the padding are unstable"; the released pipeline's ``trim_last_tokens``).
PADDED_DROP_CODES = 5


def padded_code_counts(lengths: Sequence[int]) -> list[int]:
    """Codes kept per clip when clips of ``lengths`` 24 kHz samples are encoded as one zero-padded batch.

    Every clip is padded to the longest of the batch; a padded clip (shorter than the longest) keeps
    ``ceil(n / 600) - 5`` codes (at least 0), the last five before the padding being unstable; a clip
    as long as the longest has no padding after it and keeps all ``ceil(n / 600)``. This is the
    released pipeline's rule (it drops codes "only from samples that were actually batch-padded").
    """
    lengths = [int(n) for n in lengths]
    if not lengths:
        return []
    longest = max(lengths)
    return [max(0, audio_code_count(n) - (PADDED_DROP_CODES if n < longest else 0)) for n in lengths]


def audio_sequence(codes: Any, spec: VocabSpec) -> np.ndarray:
    """``<|audio_start|>`` + code ids + ``<|audio_end|>``."""
    ids = spec.code_to_id("audio", np.asarray(codes).ravel())
    return np.concatenate([[spec.id("audio_start")], ids, [spec.id("audio_end")]]).astype(np.int64)


def audio_placeholder_sequence(num_codes: int, spec: VocabSpec) -> np.ndarray:
    """The audio structure with the ``<|audio|>`` placeholder at every code position."""
    return np.asarray([spec.id("audio_start")] + [spec.id("audio")] * int(num_codes) + [spec.id("audio_end")],
                      dtype=np.int64)


#: The paired modes: name -> the task marker that follows the audio (SPEC.md 2.2).
_TASKS = {"transcribe": "stt_transcribe", "translate": "stt_translate", "annotate": "audio_annotate"}


def transcription_sequence(codes: Any, text_ids: Sequence[int], spec: VocabSpec, task: str = "transcribe") -> np.ndarray:
    """``[audio] <task marker> text`` for the transcription, translation and annotation modes."""
    if task not in _TASKS:
        raise ValueError(f"unknown audio task {task!r}; tasks are {', '.join(_TASKS)}")
    return np.concatenate([audio_sequence(codes, spec), [spec.id(_TASKS[task])], np.asarray(text_ids, np.int64)])


def interleaved_sequences(clips: Sequence[tuple[Any, Sequence[int]]], spec: VocabSpec) -> list[np.ndarray]:
    """Interleaved speech/text sequences over one run of consecutive clips of a recording.

    ``clips`` is ``[(codes, transcript_ids), ...]`` in recording order. A sequence alternates the
    modality clip by clip: the audio of one clip, ``<|stt_continue|>``, the transcript of the
    next clip, ``<|tts_continue|>``, the audio of the clip after that, and so on; every sequence
    ends with text. The run is built twice, the copies starting one clip apart (at clip 0 and at
    clip 1), so a clip that is audio in one copy is text in the other. A clip left over at the
    end of a copy (it would end the sequence on audio) and a single-clip copy become
    transcription sequences ``[audio] <|stt_transcribe|> text`` of that clip (report 2.3.2).
    Returns the interleaved sequences first, then the transcription sequences.
    """
    interleaved: list[np.ndarray] = []
    leftovers: list[np.ndarray] = []
    for start in (0, 1):
        copy = list(clips[start:])
        if not copy:
            continue
        usable = len(copy) - (len(copy) % 2)  # an even count starts on audio and ends on text
        if usable < 2:
            leftovers.extend(transcription_sequence(c, t, spec) for c, t in copy)
            continue
        out: list[int] = []
        for k in range(usable):
            codes, text = copy[k]
            if k % 2 == 0:
                out.extend(audio_sequence(codes, spec).tolist())
                out.append(spec.id("stt_continue"))
            else:
                out.extend(int(i) for i in text)
                if k < usable - 1:
                    out.append(spec.id("tts_continue"))
        interleaved.append(np.asarray(out, dtype=np.int64))
        leftovers.extend(transcription_sequence(c, t, spec) for c, t in copy[usable:])
    return interleaved + leftovers
