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

Before any of that, the raw-bytes index skips the image's decode, preprocessing and pixel hashing
for an image seen before: the first time an image's pixel key is computed, the renderer stores an
index entry under a digest of the image's encoded bytes as received (the payload of its data URL, the
bytes fetched) and the settings that turn them into pixels (:func:`raw_key`), holding that pixel key
and the image's size. The next request with the same data URL digests the payload, reads the entry,
and reads the codes under the pixel key: the image never reaches vLLM's media loading. The
pixel-keyed entries stay the source of truth; an index entry is a shortcut, stored in the same
:class:`~apertus_plugins.infra.diskcache.DiskCache` and bound to its key the same way (an entry that
sits under another key's name, damaged or hand-placed, is a miss, removed, and the full path computes
the key again and rewrites it). The codes it points to are checked against their own key and against
the image's size, as every lookup's are. Only data URLs take the shortcut (an http URL may change
behind the same address: its bytes are fetched and decoded, then the index is written for it).

Per request, ``mm_processor_kwargs={"media_as_text": false}`` keeps every item on the multimodal path;
``APERTUS_MEDIA_AS_TEXT=0`` in the server's environment turns the lookup off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from apertus_plugins.core.media import image as media_image
from apertus_plugins.encoders.cache import MediaCodeCache, media_key

from .logs import get_logger

__all__ = ["MEDIA_AS_TEXT_ENV", "OPTION", "KnownImages", "known_sequence", "raw_key", "substitute_images"]

logger = get_logger(__name__)

#: ``0`` in the server's environment keeps every image on the multimodal path (default: on with the cache).
MEDIA_AS_TEXT_ENV = "APERTUS_MEDIA_AS_TEXT"
#: The processor option (server or request) that turns the lookup off for a request when false.
OPTION = "media_as_text"
#: The encoder precision of the served model (``vllm_model.model`` builds its tokenizers in float32).
_VARIANT = "float32"
#: The raw-bytes index: its keys' version, and the first bytes of its entries' payloads.
_INDEX_VERSION = b"apertus-media-raw-index-v1"
_INDEX_MAGIC = b"APRX1\0"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def raw_key(data: bytes, fingerprint: str, decode: str) -> str:
    """The raw-bytes index key of an image's encoded bytes ``data``, as received.

    Args:
        data: the encoded image (a PNG's, a JPEG's bytes: a data URL's payload, the bytes fetched).
        fingerprint: the vision encoder's weights fingerprint (the pixel keys' as well).
        decode: everything else that turns these bytes into the pixels the encoder gets (the resize
            policy, the media limits, the decoder's settings), as one string.
    """
    h = hashlib.sha256(_INDEX_VERSION)
    for part in (fingerprint, _VARIANT, decode):
        h.update(b"\0" + part.encode("utf-8"))
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


def _index_payload(key: str, size: tuple[int, int]) -> bytes:
    return _INDEX_MAGIC + json.dumps({"key": key, "size": [int(size[0]), int(size[1])]}).encode()


def _index_entry(payload: bytes | None) -> tuple[str, tuple[int, int]] | None:
    """``(pixel key, (height, width))`` of an index payload; ``None`` for anything else."""
    if payload is None or not payload.startswith(_INDEX_MAGIC):
        return None
    try:
        value = json.loads(payload[len(_INDEX_MAGIC):])
        key, (height, width) = value["key"], value["size"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(key, str) and _HEX64.fullmatch(key) and type(height) is int and type(width) is int
            and height > 0 and width > 0):
        return None
    return key, (height, width)


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
        return self.lookup_keys(pixels)[1]

    def lookup_keys(self, pixels: Sequence[np.ndarray | None]) -> tuple[list[str | None], list[np.ndarray | None]]:
        """The pixel key of each preprocessed image and its stored code grid (``None``: not stored, or
        not looked up)."""
        if not self.ready or not pixels:
            return [None] * len(pixels), [None] * len(pixels)
        fingerprint = self._fingerprint.result()
        keys: list[str | None] = []
        out: list[np.ndarray | None] = []
        seen: dict[str, np.ndarray | None] = {}
        for px in pixels:
            if px is None:
                keys.append(None)
                out.append(None)
                continue
            key = media_key("image", px, fingerprint, _VARIANT)
            if key not in seen:
                seen[key] = self.cache.stored(key)
            keys.append(key)
            out.append(seen[key])
        return keys, out

    # ------------------------------------------------------------------ the raw-bytes index
    def indexed(self, data: bytes, decode: str) -> tuple[str, tuple[int, int]] | None:
        """The pixel key and ``(height, width)`` the index holds for encoded bytes ``data`` (``None``: not
        indexed, not ready, or an entry that is damaged or not this key's: removed by the store)."""
        if not self.ready:
            return None
        return _index_entry(self.cache.store.get(raw_key(data, self._fingerprint.result(), decode)))

    def remember(self, data: bytes, decode: str, key: str, size: tuple[int, int]) -> bool:
        """Index encoded bytes ``data`` under their pixel ``key`` (computed from the pixels they decode to)
        and the image's ``(height, width)``; ``False`` when not stored (not ready, or already indexed so)."""
        if not self.ready or not _HEX64.fullmatch(key):
            return False
        index = raw_key(data, self._fingerprint.result(), decode)
        if _index_entry(self.cache.store.get(index)) == (key, tuple(size)):
            return False
        return self.cache.store.put(index, _index_payload(key, size))

    def known_bytes(self, data: bytes, decode: str) -> tuple[np.ndarray, tuple[int, int]] | None:
        """The stored codes and ``(height, width)`` of the image whose encoded bytes are ``data``, through
        the index (``None``: not indexed, or its codes are not stored)."""
        entry = self.indexed(data, decode)
        if entry is None:
            return None
        codes = self.cache.stored(entry[0])
        return None if codes is None else (codes, entry[1])


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
