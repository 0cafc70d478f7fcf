"""Batching by exact shape and the paths from media to codes and ids.

The encoders are not padding-invariant (crop(T(pad(x))) != T(x)), so a batch only ever holds
items of identical shape: images with the same post-resize size, clips with the same number of
samples. :func:`group_by_shape` forms such batches; :func:`encode_images` and :func:`encode_audio`
use it and return one result per item in input order. :func:`image_ids` and :func:`audio_ids` go
from a file, a PIL image or a waveform to token ids through the core's own preprocessing and
layouts (:mod:`apertus_plugins.core.media`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.core.media import image as media_image
from apertus_plugins.core.media.image import ImageLayout, PreprocessedImage, ResizePolicy, TextIds
from apertus_plugins.core.vocab import VocabSpec

from .audio import AudioTokenizer
from .vision import VisionTokenizer

if TYPE_CHECKING:
    from .cache import MediaCodeCache

__all__ = ["shape_of", "group_by_shape", "encode_images", "encode_audio", "encode_audio_padded", "image_ids",
           "audio_ids"]


def shape_of(item: Any) -> tuple[int, ...]:
    """The batching key of an item: ``pixels.shape`` of a :class:`PreprocessedImage`, else its array shape."""
    if isinstance(item, PreprocessedImage):
        return tuple(item.pixels.shape)
    return tuple(np.shape(item)) if not isinstance(item, torch.Tensor) else tuple(item.shape)


def group_by_shape(items: Sequence[Any], batch_size: int | None = None,
                   key: Callable[[Any], Hashable] = shape_of) -> list[list[int]]:
    """Batches of item indices in which every item has the same ``key`` (default: its exact shape).

    Groups appear in order of their first item, indices in input order within a group, and a
    group longer than ``batch_size`` is split into consecutive batches. Planning code that knows
    only the original sizes can pass ``key=lambda hw: media.image.resized_size(*hw)``.
    """
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    batches: list[list[int]] = []
    for idx in groups.values():
        step = batch_size or len(idx)
        batches.extend(idx[s : s + step] for s in range(0, len(idx), step))
    return batches


def encode_images(tokenizer: VisionTokenizer, images: Sequence[PreprocessedImage | np.ndarray],
                  batch_size: int = 8, cache: MediaCodeCache | None = None) -> list[np.ndarray]:
    """Code grids of many images, batched by exact shape.

    Args:
        tokenizer: the vision tokenizer.
        images: :class:`PreprocessedImage` items (from ``media.image.preprocess_image``) or float32
            ``[3, H, W]`` pixel arrays in [-1, 1].
        batch_size: most images per forward pass (only same-shape images share one).
        cache: a :class:`~apertus_plugins.encoders.cache.MediaCodeCache`: stored grids are read
            from it, only the misses are encoded (batched as usual) and then stored.

    Returns:
        One int64 ``[rows, cols]`` grid per image, in input order.
    """
    if cache is not None:
        return cache.codes("image", tokenizer, images,
                           lambda todo: encode_images(tokenizer, [images[i] for i in todo], batch_size))
    out: list[np.ndarray | None] = [None] * len(images)
    for batch in group_by_shape(images, batch_size):
        pixels = np.stack([_pixels(images[i]) for i in batch])
        codes = tokenizer.encode(torch.from_numpy(pixels)).cpu().numpy()
        for j, i in enumerate(batch):
            out[i] = codes[j]
    return out  # type: ignore[return-value]


def _pixels(item: PreprocessedImage | np.ndarray) -> np.ndarray:
    return np.asarray(item.pixels if isinstance(item, PreprocessedImage) else item, dtype=np.float32)


def encode_audio(tokenizer: AudioTokenizer, clips: Sequence[np.ndarray], batch_size: int = 8,
                 cache: MediaCodeCache | None = None) -> list[np.ndarray]:
    """Codes of many 24 kHz mono clips (as ``media.audio.preprocess_audio`` returns them), batched by length.

    ``cache``: as for :func:`encode_images` (only the clips not stored are encoded).

    Returns:
        One int64 array of ``ceil(len / 600)`` codes per clip, in input order.
    """
    if cache is not None:
        return cache.codes("audio", tokenizer, clips,
                           lambda todo: encode_audio(tokenizer, [clips[i] for i in todo], batch_size))
    out: list[np.ndarray | None] = [None] * len(clips)
    for batch in group_by_shape(clips, batch_size):
        wave = np.stack([np.asarray(clips[i], dtype=np.float32) for i in batch])
        codes = tokenizer.encode(torch.from_numpy(wave)).cpu().numpy()
        for j, i in enumerate(batch):
            out[i] = codes[j]
    return out  # type: ignore[return-value]


def encode_audio_padded(tokenizer: AudioTokenizer, clips: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Codes of 24 kHz mono clips encoded as ONE batch padded to the longest, as the report batches audio.

    Every clip is zero-padded on the right to the longest clip's length, the batch is encoded in one
    forward pass, and each clip keeps ``media.audio.padded_code_counts`` codes: all of them for a
    clip as long as the longest, ``ceil(n / 600) - 5`` for a padded one (report 2.3.2). The codes of
    a clip therefore depend on the clips it shares the batch with; :func:`encode_audio` (exact
    lengths, nothing dropped) is the default everywhere. No media-code cache: the cache keys a
    clip by its own samples, which no longer decide its codes.

    Returns:
        One int64 array per clip, in input order.
    """
    if not clips:
        return []
    arrays = [np.asarray(c, dtype=np.float32).ravel() for c in clips]
    lengths = [a.size for a in arrays]
    if min(lengths) == 0:
        raise ValueError("encode_audio_padded: a clip has no samples")
    wave = np.zeros((len(arrays), max(lengths)), dtype=np.float32)
    for row, a in zip(wave, arrays, strict=True):
        row[: a.size] = a
    codes = tokenizer.encode(torch.from_numpy(wave)).cpu().numpy()
    return [codes[j, :keep].astype(np.int64) for j, keep in enumerate(media_audio.padded_code_counts(lengths))]


def image_ids(tokenizer: VisionTokenizer, image: Any, spec: VocabSpec, layout: str | ImageLayout = "inference",
              text_ids: TextIds | None = None, policy: str | ResizePolicy = "released") -> np.ndarray:
    """Token ids of one image: preprocess, encode, lay out (``media.image.image_sequence``).

    Args:
        image: a path, a PIL image or a uint8 array (see ``media.image.to_rgb_array``).
        spec: the vocabulary layout (code ``i`` becomes ``spec``'s image offset + i).
        layout: ``"inference"`` (serving default) or ``"training"``.
        text_ids: tokenizes the ``"rows*cols"`` header, e.g. ``media.image.text_ids_from_tokenizer(dir)``.
        policy: the resize policy (default: the released processor's).
    """
    pre = media_image.preprocess_image(image, policy)
    grid = encode_images(tokenizer, [pre], batch_size=1)[0]
    return media_image.image_sequence(grid, spec, layout, text_ids)


def audio_ids(tokenizer: AudioTokenizer, source: str | Path | bytes | np.ndarray, spec: VocabSpec,
              sample_rate: int | None = None, policy: str | media_audio.AudioPolicy = "released") -> np.ndarray:
    """Token ids of one clip: load (a path or bytes) or take a waveform, preprocess, encode, lay out.

    Args:
        source: a file path, the file's bytes, or a waveform ``[samples]`` / ``[channels, samples]``.
        sample_rate: the waveform's rate in Hz (required for arrays, ignored for files).
        policy: the audio preprocessing policy (default: the released feature extractor's).

    Returns:
        ``<|audio_start|>`` + code ids + ``<|audio_end|>`` (``media.audio.audio_sequence``).
    """
    if isinstance(source, (str, Path, bytes, bytearray, memoryview)):
        wave, rate = media_audio.load_audio(source)
    else:
        if sample_rate is None:
            raise ValueError("audio_ids: a waveform needs its sample_rate")
        wave, rate = np.asarray(source), int(sample_rate)
    clip = media_audio.preprocess_audio(wave, rate, policy)
    codes = encode_audio(tokenizer, [clip], batch_size=1)[0]
    return media_audio.audio_sequence(codes, spec)
