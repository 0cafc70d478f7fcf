"""The media tokenizers of Apertus 1.5 as PyTorch modules (encode only): IBQ vision, WavTokenizer audio.

The configs (:class:`VisionTokenizerConfig`, :class:`AudioTokenizerConfig`) import without torch;
everything else needs it (the ``[torch]`` extra) and is imported on first use. The public API:

- :class:`VisionTokenizer`: ``encode(pixels [B,3,H,W] in [-1,1]) -> LongTensor [B,H/16,W/16]``.
- :class:`AudioTokenizer`: ``encode(wave [B,T] or [B,1,T] at 24 kHz) -> LongTensor [B,ceil(T/600)]``.
- :func:`group_by_shape`, :func:`encode_images`, :func:`encode_audio`: batching by exact shape
  (never padding), one result per item in input order.
- :func:`image_ids`, :func:`audio_ids`: from a file, PIL image or waveform to token ids through
  the core's preprocessing and layouts.
- :func:`load_vision_tokenizer`, :func:`load_audio_tokenizer`, :func:`load_media_tokenizers`:
  strict loaders for the released checkpoint layout and the original Emu3.5 / WavTokenizer files.
- :class:`MediaCodeCache`: the persistent, content-addressed media-code cache (``cache=`` of
  :func:`encode_images` / :func:`encode_audio`; ``APERTUS_MEDIA_CACHE=DIR`` turns it on).
- Precision: ``"float32"`` (default) or ``"tf32"`` (CUDA), a setting of each encoder applied
  around its forward pass; half precision is refused (:class:`PrecisionError`).

Callers batch only items of identical shape: images with the same post-resize size, clips with
the same number of samples (the encoders are not padding-invariant).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import AudioTokenizerConfig, VisionTokenizerConfig

_LAZY = {
    "VisionTokenizer": "vision", "select_codes_by_dot_product": "vision", "SCORE_BUDGET_BYTES": "vision",
    "AudioTokenizer": "audio", "select_codes_by_distance": "audio",
    "group_by_shape": "api", "shape_of": "api", "encode_images": "api", "encode_audio": "api", "encode_audio_padded": "api",
    "image_ids": "api", "audio_ids": "api",
    "Precision": "precision", "PRECISIONS": "precision", "PrecisionError": "precision",
    "precision_scope": "precision", "encode_threads": "threads", "planned_threads": "threads",
    "CheckpointError": "loaders", "FORMATS": "loaders", "detect_format": "loaders",
    "load_vision_tokenizer": "loaders", "load_audio_tokenizer": "loaders", "load_media_tokenizers": "loaders",
    "read_emu35_config": "loaders", "infer_wavtokenizer_config": "loaders",
    "FlopCount": "flops", "vision_flops": "flops", "audio_flops": "flops",
    "MediaCodeCache": "cache", "weights_fingerprint": "cache", "media_key": "cache",
}

__all__ = [
    "VisionTokenizerConfig", "AudioTokenizerConfig", "VisionTokenizer", "AudioTokenizer",
    "group_by_shape", "shape_of", "encode_images", "encode_audio", "encode_audio_padded", "image_ids", "audio_ids",
    "select_codes_by_dot_product", "select_codes_by_distance", "SCORE_BUDGET_BYTES",
    "Precision", "PRECISIONS", "PrecisionError", "precision_scope", "encode_threads", "planned_threads",
    "CheckpointError", "FORMATS", "detect_format", "load_vision_tokenizer", "load_audio_tokenizer",
    "load_media_tokenizers", "read_emu35_config", "infer_wavtokenizer_config",
    "FlopCount", "vision_flops", "audio_flops",
    "MediaCodeCache", "weights_fingerprint", "media_key",
]

if TYPE_CHECKING:
    from .api import audio_ids, encode_audio, encode_audio_padded, encode_images, group_by_shape, image_ids, shape_of
    from .audio import AudioTokenizer, select_codes_by_distance
    from .cache import MediaCodeCache, media_key, weights_fingerprint
    from .flops import FlopCount, audio_flops, vision_flops
    from .loaders import (
        FORMATS,
        CheckpointError,
        detect_format,
        infer_wavtokenizer_config,
        load_audio_tokenizer,
        load_media_tokenizers,
        load_vision_tokenizer,
        read_emu35_config,
    )
    from .precision import PRECISIONS, Precision, PrecisionError, precision_scope
    from .threads import encode_threads, planned_threads
    from .vision import SCORE_BUDGET_BYTES, VisionTokenizer, select_codes_by_dot_product


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
