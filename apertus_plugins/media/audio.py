"""Audio as token sequences (SPEC.md 2.2): loading, 24 kHz mono at -3 dBFS, code counts, layouts.

WavTokenizer emits one code per 600 samples at 24 kHz (40 codes per second), so a clip of n
samples costs ceil(n / 600) codes. The sequence of a clip is ``<|audio_start|>`` + codes +
``<|audio_end|>``; the training modes add the task markers.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ..vocab import VocabSpec

__all__ = [
    "SAMPLE_RATE", "HOP", "TARGET_PEAK_DBFS", "AudioError", "load_audio", "preprocess_audio", "audio_code_count",
    "audio_sequence", "audio_placeholder_sequence", "transcription_sequence", "interleaved_sequences",
]

SAMPLE_RATE = 24_000
HOP = 600
TARGET_PEAK_DBFS = -3.0


class AudioError(ValueError):
    """Audio that cannot be turned into a token sequence; the message names it."""


def load_audio(source: str | Path | bytes) -> tuple[np.ndarray, int]:
    """Decode a file (or bytes) to float32 ``[channels, samples]`` and its sample rate."""
    import soundfile as sf

    name = "<bytes>" if isinstance(source, (bytes, bytearray)) else str(source)
    if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
        raise FileNotFoundError(f"{name}: no such audio file")
    try:
        data, rate = sf.read(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source),
                             dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(f"{name}: not a readable audio file ({exc})") from exc
    if data.shape[0] == 0:
        raise AudioError(f"{name}: the audio has no samples")
    return np.ascontiguousarray(data.T), int(rate)


def preprocess_audio(waveform: Any, sample_rate: int) -> np.ndarray:
    """Downmix to mono, resample to 24 kHz (polyphase, exact ratio), peak-normalize to -3 dBFS.

    ``waveform`` is ``[samples]`` or ``[channels, samples]``. The normalization is the released
    feature extractor's: ``x * (10 ** (-3 / 20) / max(max|x|, 1e-10))``.
    """
    x = np.asarray(waveform, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=0, dtype=np.float32)
    elif x.ndim != 1:
        raise AudioError(f"audio must be [samples] or [channels, samples], got shape {x.shape}")
    if x.size == 0:
        raise AudioError("the audio has no samples")
    if sample_rate <= 0:
        raise AudioError(f"invalid sample rate {sample_rate}")
    if sample_rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        ratio = Fraction(SAMPLE_RATE, sample_rate)
        x = resample_poly(x, ratio.numerator, ratio.denominator).astype(np.float32)
    target = 10.0 ** (TARGET_PEAK_DBFS / 20.0)
    return (x * (target / max(float(np.abs(x).max()), 1e-10))).astype(np.float32)


def audio_code_count(num_samples: int) -> int:
    """Codes for a 24 kHz clip of ``num_samples`` samples: ceil(samples / 600)."""
    return -(-int(num_samples) // HOP)


def audio_sequence(codes: Any, spec: VocabSpec) -> np.ndarray:
    """``<|audio_start|>`` + code ids + ``<|audio_end|>``."""
    ids = spec.code_to_id("audio", np.asarray(codes).ravel())
    return np.concatenate([[spec.id("audio_start")], ids, [spec.id("audio_end")]]).astype(np.int64)


def audio_placeholder_sequence(num_codes: int, spec: VocabSpec) -> np.ndarray:
    """The audio structure with the ``<|audio|>`` placeholder at every code position."""
    return np.asarray([spec.id("audio_start")] + [spec.id("audio")] * int(num_codes) + [spec.id("audio_end")],
                      dtype=np.int64)


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
