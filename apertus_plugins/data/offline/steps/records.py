"""The typed records that flow between the steps of a batch: read -> preprocess -> encode -> pack -> write.

* :class:`Decoded`: the batch after reading and preprocessing (its items, the preprocessed media
  arrays by modality, the items skipped so far, the parsed conversations, what was read);
* :class:`Encoded`: the codes of those arrays, the arrays the encoder failed on, and its clock;
* :class:`Packed`: the documents of every stream, by item, and every item skipped up to then.

Each is a plain dataclass that pickles (local worker processes, Ray tasks and actors pass them).
The batch's record on disk (its checkpoint) stays a JSON document: see :class:`.write.Write`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan import BatchRef
from ..sources import Item, Skip

__all__ = ["Arrays", "Decoded", "Encoded", "Packed"]

#: per modality: the ``(item index, media position)`` of each array, and the arrays in that order
Arrays = dict[str, tuple[list[tuple[int, int]], list[np.ndarray]]]


@dataclass
class Decoded:
    """A batch after its CPU steps: items, preprocessed media by modality, skips, parsed conversations."""

    ref: BatchRef
    items: list[Item]
    arrays: Arrays = field(default_factory=dict)
    skips: dict[int, Skip] = field(default_factory=dict)
    conversations: dict[int, Any] = field(default_factory=dict)
    read: dict[str, Any] = field(default_factory=dict)
    decode_s: float = 0.0

    def without_arrays(self) -> Decoded:
        """The same batch with only the arrays' keys (the arrays travel to the encoder apart)."""
        return Decoded(self.ref, self.items, {k: (keys, []) for k, (keys, _a) in self.arrays.items()}, self.skips,
                       self.conversations, self.read, self.decode_s)


@dataclass
class Encoded:
    """What the encode step gives for a batch's arrays.

    ``codes``: per modality, the codes of each array in order (``None`` where the encoder failed);
    ``failed``: per modality, the failed arrays' positions and the errors; ``encode_s``: seconds in
    the encoders (loading one is not counted), ``load_s`` seconds loading them; ``device``,
    ``loads``: the encoders' device and how many were loaded in this process; ``encoder``: this
    process, with ``busy_s`` (encoder seconds so far) and ``uptime_s`` (seconds since its first
    encoder was loaded): their ratio is the encoder's utilisation; ``media_cache``: with the
    media-code cache on, the arrays found in it (``hits``) and encoded (``misses``).
    """

    codes: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    failed: dict[str, dict[int, str]] = field(default_factory=dict)
    encode_s: float = 0.0
    load_s: float = 0.0
    device: str | None = None
    loads: int = 0
    encoder: dict[str, Any] | None = None
    media_cache: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (``media_cache`` only when the cache is on)."""
        out = {"codes": self.codes, "failed": self.failed, "encode_s": self.encode_s, "load_s": self.load_s,
               "device": self.device, "loads": self.loads, "encoder": self.encoder}
        if self.media_cache is not None:
            out["media_cache"] = self.media_cache
        return out

    def append(self, kind: str, got: Encoded) -> None:
        """Add ``got``'s codes of ``kind`` (and its failures, by their position here) after these."""
        codes = self.codes.setdefault(kind, [])
        for pos, msg in got.failed.get(kind, {}).items():
            self.failed.setdefault(kind, {})[len(codes) + pos] = msg
        codes.extend(got.codes.get(kind, []))

    def took(self, got: Encoded) -> None:
        """Count ``got``'s encoder time and take its device, process and cache view (the latest)."""
        self.encode_s += got.encode_s
        self.load_s, self.device, self.loads, self.encoder = got.load_s, got.device, got.loads, got.encoder
        self.media_cache = got.media_cache


@dataclass
class Packed:
    """The documents of a batch (per item: ids, and masks, by stream suffix) and every skip so far."""

    docs: list[tuple[int, dict[str, np.ndarray]]]
    skips: dict[int, Skip]
