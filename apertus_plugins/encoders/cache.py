"""The persistent media-code cache: codes of images and clips already encoded, shared by processes.

Encoding an image is most of a multimodal request's time on CPU, and the same pictures come back
(a rerun of an evaluation, a system prompt's logo, a dataset tokenized twice). With the cache on,
every encoder call of ``vllm serve``, ``apertus tokenize``, ``apertus encode`` and the evaluation
models first looks each item up, encodes only the misses (still batched by shape) and stores them.

The key is content-addressed (:func:`media_key`): a SHA-256 of

- the modality (``"image"``, ``"audio"``, a plugin's),
- the encoder's fingerprint (:func:`weights_fingerprint`: a digest of its tensors, names, shapes,
  dtypes and config, taken once per loaded module) and its precision (``float32``/``tf32``),
- the item exactly as the encoder gets it: the preprocessed pixels or samples, their dtype and
  shape. The resize or audio policy shaped these arrays, so two policies never share an entry.

The value is the codebook indices (before any vocabulary offset), so the image layout
(``inference``/``training``) applied afterwards is not part of the key: both layouts share the
codes. Entries live in a :class:`~apertus_plugins.infra.diskcache.DiskCache` (atomic writes,
checked reads, least-recently-used eviction within a byte bound).

Opt-in: ``APERTUS_MEDIA_CACHE=DIR`` (or ``1`` for ``~/.cache/apertus-plugins/media-codes``),
``APERTUS_MEDIA_CACHE_SIZE=4GB`` (default :data:`DEFAULT_SIZE`), or the commands' ``--media-cache``
flags. numpy is the only import; torch is used when a module's fingerprint is taken.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from apertus_plugins.infra.diskcache import DiskCache
from apertus_plugins.infra.sizes import parse_size

__all__ = ["MEDIA_CACHE_ENV", "MEDIA_CACHE_SIZE_ENV", "DEFAULT_SIZE", "MediaCodeCache", "default_directory",
           "media_key", "weights_fingerprint", "forget_fingerprint"]

logger = logging.getLogger(__name__)

#: ``DIR`` turns the cache on there; ``1``/``on``/``true`` uses :func:`default_directory`; unset, empty, ``0``: off.
MEDIA_CACHE_ENV = "APERTUS_MEDIA_CACHE"
#: The bound on the cache's bytes on disk (``500MB``, ``4GB``...).
MEDIA_CACHE_SIZE_ENV = "APERTUS_MEDIA_CACHE_SIZE"
#: The default bound (2 GiB: about 250,000 code grids of a 512x512 image).
DEFAULT_SIZE = 2 * 2**30
_ON = {"1", "on", "true", "yes"}
_OFF = {"", "0", "off", "false", "no"}
_KEY_VERSION = b"apertus-media-codes-v1"


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/apertus-plugins/media-codes`` (``~/.cache/...`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "apertus-plugins" / "media-codes"


# ---------------------------------------------------------------------------- keys
def _array_bytes(item: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, raw bytes) of an item; numpy and torch arrays of one dtype give the same triple."""
    pixels = getattr(item, "pixels", None)  # core.media.image.PreprocessedImage
    if pixels is not None:
        item = pixels
    if hasattr(item, "detach"):  # a torch tensor: the same bytes as its numpy view wherever numpy has the dtype
        t = item.detach().cpu().contiguous()
        try:
            item = t.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            import torch

            return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()
    a = np.ascontiguousarray(item)
    return a.dtype.str, tuple(a.shape), a.tobytes()


def media_key(modality: str, item: Any, fingerprint: str, variant: str = "") -> str:
    """The hexadecimal cache key of one preprocessed item for one encoder (see the module docstring).

    Args:
        modality: ``"image"``, ``"audio"`` or a plugin modality's name.
        item: the array the encoder gets (numpy, torch, or a ``PreprocessedImage``).
        fingerprint: the encoder's :func:`weights_fingerprint`.
        variant: whatever else changes the codes (the encoder's precision).
    """
    dtype, shape, raw = _array_bytes(item)
    h = hashlib.sha256(_KEY_VERSION)
    for part in (modality, fingerprint, variant, dtype, ",".join(map(str, shape))):
        h.update(b"\0" + part.encode("utf-8"))
    h.update(b"\0")
    h.update(raw)
    return h.hexdigest()


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def weights_fingerprint(module: Any) -> str:
    """A SHA-256 of an encoder module's tensors (names, dtypes, shapes, values) and its config.

    Taken once per module object and remembered (:func:`forget_fingerprint` drops it after the
    weights change in place). It reads every tensor once: about a second per GB of weights.
    """
    cached = _FINGERPRINTS.get(module)
    if cached is not None:
        return cached
    import torch

    h = hashlib.sha256(type(module).__name__.encode())
    h.update(repr(getattr(module, "config", None)).encode())
    state = module.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    value = h.hexdigest()
    _FINGERPRINTS[module] = value
    return value


def forget_fingerprint(module: Any) -> None:
    """Forget ``module``'s remembered fingerprint (call it after loading new weights into it)."""
    _FINGERPRINTS.pop(module, None)


# ---------------------------------------------------------------------------- values
def _dump(codes: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(codes), allow_pickle=False)
    return buf.getvalue()


def _load(payload: bytes) -> np.ndarray | None:
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        return None


# ---------------------------------------------------------------------------- the cache
class MediaCodeCache:
    """Codes by content, on disk: look up each item, encode only the misses, store them.

    Counters of this process: ``hits``, ``misses`` (items the encoder had to run on); the
    store's own (``store.stats()``: corrupt entries removed, evictions) are in :meth:`stats`.

    Args:
        directory: where the entries live (created if missing).
        max_bytes: the bound on the entries' bytes on disk (least recently used go first).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_SIZE) -> None:
        self.store = DiskCache(directory, max_bytes)
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"MediaCodeCache({str(self.store.directory)!r}, max_bytes={self.store.max_bytes})"

    @classmethod
    def resolve(cls, value: str | os.PathLike[str] | None, size: str | int | None = None,
                environ: Mapping[str, str] | None = None) -> MediaCodeCache | None:
        """The cache a command asked for: ``value`` (a flag) else ``$APERTUS_MEDIA_CACHE``; ``None`` when off.

        ``value``/the variable: a directory, ``1``/``on``/``true`` (the default directory), or
        ``0``/``off``/empty (off). ``size`` (a flag) else ``$APERTUS_MEDIA_CACHE_SIZE`` else 2 GiB.
        """
        env = os.environ if environ is None else environ
        raw = str(value) if value is not None else env.get(MEDIA_CACHE_ENV, "")
        text = raw.strip()
        if text.lower() in _OFF:
            return None
        directory = default_directory() if text.lower() in _ON else Path(text).expanduser()
        size_text = size if size is not None else env.get(MEDIA_CACHE_SIZE_ENV) or None
        try:
            max_bytes = parse_size(size_text) if size_text is not None else DEFAULT_SIZE
        except ValueError as exc:
            raise ValueError(f"{MEDIA_CACHE_SIZE_ENV} / --media-cache-size: {exc}") from None
        if not max_bytes:
            raise ValueError(f"{MEDIA_CACHE_SIZE_ENV} / --media-cache-size: the size must be positive, got {size_text!r}")
        try:
            return cls(directory, max_bytes)
        except OSError as exc:
            raise ValueError(f"{MEDIA_CACHE_ENV} / --media-cache: cannot use {directory} as the media cache ({exc})") \
                from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MediaCodeCache | None:
        """The cache ``$APERTUS_MEDIA_CACHE`` asks for, or ``None`` (the default: off)."""
        return cls.resolve(None, None, environ)

    def codes(self, modality: str, encoder: Any, items: Sequence[Any],
              encode: Callable[[list[int]], Sequence[Any]], variant: str | None = None,
              fingerprint: str | None = None) -> list[np.ndarray]:
        """The codes of ``items``, from the cache where stored, else from ``encode``.

        Args:
            modality: ``"image"``, ``"audio"`` or a plugin modality.
            encoder: the encoder module (its :func:`weights_fingerprint` enters the key).
            items: the preprocessed arrays the encoder gets, in order.
            encode: called once with the indices of the misses (identical items once), returns
                their codes in that order; it batches them as it likes.
            variant: what else shapes the codes (default: the encoder's ``precision`` attribute).
            fingerprint: the encoder's fingerprint when the caller has it (default: taken from ``encoder``).

        Returns:
            One numpy array of codes per item, in input order.
        """
        if not items:
            return []
        fingerprint = weights_fingerprint(encoder) if fingerprint is None else fingerprint
        variant = str(getattr(encoder, "precision", "")) if variant is None else variant
        keys = [media_key(modality, item, fingerprint, variant) for item in items]
        out: list[np.ndarray | None] = [None] * len(items)
        seen: dict[str, int] = {}  # key -> its first item
        todo: list[int] = []
        for i, key in enumerate(keys):
            if key in seen:
                continue
            seen[key] = i
            payload = self.store.get(key)
            found = _load(payload) if payload is not None else None
            if found is None:
                todo.append(i)
            else:
                out[i] = found
        if todo:
            got = encode(todo)
            if len(got) != len(todo):
                raise RuntimeError(f"media cache: the encoder returned {len(got)} results for {len(todo)} items")
            for i, codes in zip(todo, got, strict=True):
                arr = np.asarray(codes.detach().cpu() if hasattr(codes, "detach") else codes)
                out[i] = arr
                self.store.put(keys[i], _dump(arr))
        for i, key in enumerate(keys):  # repeats of one item in this call
            if out[i] is None:
                out[i] = out[seen[key]]
        self.misses += len(todo)
        self.hits += len(items) - len(todo)
        logger.debug("media cache %s: %d of %d %s items from the cache", self.store.directory,
                     len(items) - len(todo), len(items), modality)
        return out  # type: ignore[return-value]

    def stored(self, key: str) -> np.ndarray | None:
        """The codes stored under ``key`` (a :func:`media_key`), or ``None``; encodes nothing, counts nothing.

        Used where the encoder is elsewhere (vLLM's API server puts stored images into the prompt as ids).
        """
        payload = self.store.get(key)
        return _load(payload) if payload is not None else None

    def stats(self) -> dict[str, int]:
        """``hits``, ``misses`` (items encoded), ``corrupt``, ``evicted``, ``stores`` of this process."""
        s = self.store.stats()
        return {"hits": self.hits, "misses": self.misses, "corrupt": s["corrupt"], "evicted": s["evicted"],
                "stores": s["stores"]}

    def summary(self) -> str:
        """One line for logs: ``media cache DIR: 12 hits, 3 misses``."""
        return f"media cache {self.store.directory}: {self.hits} hits, {self.misses} misses"
