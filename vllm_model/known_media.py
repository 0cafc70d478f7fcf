"""Images whose codes are already known go into the prompt as token ids: the engine sees text only.

Apertus 1.5 reads an image as discrete tokens: once its codes are known, the image *is* a run of
token ids (:func:`apertus_plugins.core.media.image.image_sequence`). With the persistent media-code
cache on (``APERTUS_MEDIA_CACHE``, :mod:`apertus_plugins.encoders.cache`), the chat renderer
(:mod:`vllm_model.renderer`) looks every image of a request up in the cache, in the API server,
before the request reaches vLLM's multimodal path; an image found there is written into the prompt
as its ids (structure tokens and code ids, exactly the sequence the processor would have built with
the codes embedded at the placeholder positions) and dropped from the request's media. A request
whose images are all known is a text-only prompt: no multimodal processor, no encoder scheduling, and
vLLM's prefix cache serves a repeated image as it serves repeated text. The embeddings are the same
(the model embeds codes with the decoder's own embedding either way), so the greedy tokens and
log-probabilities are those of the multimodal path.

The cache key holds the vision encoder's weights fingerprint (:func:`~apertus_plugins.encoders.cache.
weights_fingerprint`), which the API server does not have: :class:`KnownImages` loads the vision
encoder from the served checkpoint once, in a background thread when the renderer starts, takes the
fingerprint and frees the module. Until it is ready (or when it cannot be taken: a checkpoint
without a loadable vision encoder) every image takes the multimodal path, which is always correct.
Identical images of one request are looked up once; an image the cache lacks takes the multimodal
path (the engine encodes it once, however often it repeats, and stores it, so the next request
finds it). Audio always takes the multimodal path.

Per request, ``mm_processor_kwargs={"media_as_text": false}`` keeps every item on the multimodal path;
``APERTUS_MEDIA_AS_TEXT=0`` in the server's environment turns the lookup off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from apertus_plugins.core.media import image as media_image
from apertus_plugins.encoders.cache import MediaCodeCache, media_key

from .logs import get_logger

__all__ = ["MEDIA_AS_TEXT_ENV", "OPTION", "KnownImages", "known_sequence", "substitute_images"]

logger = get_logger(__name__)

#: ``0`` in the server's environment keeps every image on the multimodal path (default: on with the cache).
MEDIA_AS_TEXT_ENV = "APERTUS_MEDIA_AS_TEXT"
#: The processor option (server or request) that turns the lookup off for a request when false.
OPTION = "media_as_text"
#: The encoder precision of the served model (``vllm_model.model`` builds its tokenizers in float32).
_VARIANT = "float32"


def _vision_fingerprint(checkpoint: str) -> str:
    """The fingerprint of the served checkpoint's vision encoder, as the engine's model computes it."""
    from apertus_plugins.encoders import load_vision_tokenizer
    from apertus_plugins.encoders.cache import weights_fingerprint

    module = load_vision_tokenizer(checkpoint, precision=_VARIANT)
    try:
        return weights_fingerprint(module)
    finally:
        del module


class KnownImages:
    """The API server's read-only view of the media-code cache, keyed like the engine's model.

    Args:
        cache: the cache the server's model writes (``APERTUS_MEDIA_CACHE``).
        checkpoint: the served checkpoint (a directory or a Hub id), whose vision encoder keys the entries.
        pool: where the one-time fingerprint is taken (in the background).
    """

    def __init__(self, cache: MediaCodeCache, checkpoint: str, pool: ThreadPoolExecutor) -> None:
        self.cache = cache
        self.checkpoint = checkpoint
        self._fingerprint: Future[str] = pool.submit(_vision_fingerprint, checkpoint)
        self._fingerprint.add_done_callback(self._announce)

    @classmethod
    def start(cls, checkpoint: str, pool: ThreadPoolExecutor,
              environ: Mapping[str, str] | None = None) -> KnownImages | None:
        """The lookup of a server whose environment turns the cache on (``None``: off, or turned off)."""
        env = os.environ if environ is None else environ
        if env.get(MEDIA_AS_TEXT_ENV, "1").strip().lower() in {"0", "off", "false", "no"}:
            return None
        try:
            cache = MediaCodeCache.from_env(env)
        except ValueError as exc:  # the engine's model refuses the same setting with this message
            logger.warning("apertus: images stay on the multimodal path: %s", exc)
            return None
        return None if cache is None else cls(cache, checkpoint, pool)

    def _announce(self, job: Future[str]) -> None:
        exc = job.exception()
        if exc is None:
            logger.info("apertus: images whose codes are in %r reach the engine as token ids", self.cache)
        else:
            logger.warning("apertus: images stay on the multimodal path (the vision encoder of %s could not be "
                           "fingerprinted: %s: %s)", self.checkpoint, type(exc).__name__, exc)

    @property
    def ready(self) -> bool:
        """Whether the fingerprint is taken (before that, and if it failed, nothing is known)."""
        return self._fingerprint.done() and self._fingerprint.exception() is None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fingerprint (tests, benchmarks); returns :attr:`ready`."""
        try:
            self._fingerprint.result(timeout)
        except Exception:  # noqa: BLE001 - reported by _announce; nothing is known then
            return False
        return True

    def lookup(self, pixels: Sequence[np.ndarray | None]) -> list[np.ndarray | None]:
        """The stored code grid of each preprocessed image (``None``: not stored, or not looked up)."""
        if not self.ready or not pixels:
            return [None] * len(pixels)
        fingerprint = self._fingerprint.result()
        out: list[np.ndarray | None] = []
        seen: dict[str, np.ndarray | None] = {}
        for px in pixels:
            if px is None:
                out.append(None)
                continue
            key = media_key("image", px, fingerprint, _VARIANT)
            if key not in seen:
                seen[key] = self.cache.stored(key)
            out.append(seen[key])
        return out


def substitute_images(ids: Sequence[int], image_id: int, sequences: Sequence[np.ndarray | None]) -> list[int] | None:
    """``ids`` with the k-th ``<|image|>`` placeholder replaced by ``sequences[k]`` where that is not ``None``.

    Returns ``None`` when the prompt's placeholders are not one per image (nothing is replaced then:
    the request takes the multimodal path).
    """
    where = [i for i, t in enumerate(ids) if t == image_id]
    if len(where) != len(sequences):
        return None
    out: list[int] = []
    start = 0
    for pos, seq in zip(where, sequences, strict=True):
        if seq is None:
            continue
        out += ids[start:pos]
        out += [int(t) for t in seq]
        start = pos + 1
    out += ids[start:]
    return out


def known_sequence(codes: np.ndarray, size: tuple[int, int], info: Any, options: Mapping[str, Any]) -> np.ndarray | None:
    """The ids of an image of original ``(height, width)`` from its stored ``codes``, in the request's layout.

    ``None`` when the grid does not have the shape the processor expects for that size (never served
    as another image's codes: the multimodal path encodes it).
    """
    rows, cols = media_image.image_grid(size[0], size[1], options["resize_policy"])
    grid = np.asarray(codes)
    if grid.shape != (rows, cols) or not np.issubdtype(grid.dtype, np.integer):
        return None
    try:
        return media_image.image_sequence(grid, info.spec, options["image_layout"], info.chat_tokenizer.char_ids)
    except ValueError:  # codes outside the codebook: not this model's entry
        return None
