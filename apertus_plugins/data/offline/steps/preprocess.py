"""The CPU step of a batch: each item's conversation (or recording) parsed and its media read, decoded and resized.

Whatever one item raises costs only that item: it is skipped with its reason at stage ``decode``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import storage
from ..faults import crash_point
from ..sources import (
    BadInput,
    Item,
    MediaRef,
    Reasons,
    Skip,
    media_base,
    parse_record,
    parse_recording,
    part_source,
    plugin_modality,
    read_media,
    unexpected,
)
from .context import RunContext
from .records import Decoded

__all__ = ["Preprocess", "strip_name"]

#: a conversation as read again from its JSONL line: messages, tools, thinking, the base of its media paths
Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool | None, str]


class Preprocess:
    """Items' media as preprocessed arrays (pixels ``[3, H, W]`` or samples at 24 kHz) in a :class:`Decoded`,
    through the run's :class:`~..preprocess.MediaSettings`."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, items: list[Item], out: Decoded) -> None:
        """Add the arrays of ``items`` to ``out`` by modality (skipping the items that fail)."""
        for it in items:
            media = None
            try:
                inline = None
                if it.kind == "conversation":
                    out.conversations[it.index] = rec = self.conversation(it)
                    inline = (self._normalized(it, rec[0]), rec[3])
                elif it.kind == "recording":
                    out.conversations[it.index] = self.recording(it)
                for k, ref_ in enumerate(it.media):
                    media = ref_.name
                    if ref_.inline is None:
                        out.read["media"].append([ref_.path, ref_.offset, ref_.size])
                    crash_point(ref_.name)
                    arr = self.load(ref_, inline)
                    keys, arrays = out.arrays.setdefault(ref_.kind, ([], []))
                    keys.append((it.index, k))
                    arrays.append(arr)
            except BadInput as exc:
                out.skips[it.index] = Skip(it.name, exc.reason, exc.detail, "decode")
            except Exception as exc:  # noqa: BLE001 (one item's failure costs only that item)
                out.skips[it.index] = unexpected(it.name, "decode", exc, media)
        for kind, (keys, arrays) in list(out.arrays.items()):  # an item skipped after one of its media loaded
            keep = [n for n, key in enumerate(keys) if key[0] not in out.skips]
            out.arrays[kind] = ([keys[n] for n in keep], [arrays[n] for n in keep])

    def conversation(self, item: Item) -> Conversation:
        """A conversation read again from its line of the JSONL file."""
        path, offset, length = item.record or ("", 0, 0)
        raw = storage.read_bytes(path, offset, length)
        messages, tools, thinking = parse_record(raw, item.name)
        return messages, tools, thinking, media_base(path, self.ctx.cfg.media_root)

    def recording(self, item: Item) -> list[str]:
        """The transcripts of a recording's clips (interleaved runs), read again from its JSONL line."""
        path, offset, length = item.record or ("", 0, 0)
        clips = parse_recording(storage.read_bytes(path, offset, length), item.name)
        if len(clips) != len(item.media):
            raise BadInput(Reasons.RECORDING, f"{item.name}: {len(clips)} clips, the plan has {len(item.media)} "
                           "(the file changed since it was planned)")
        return [c.text for c in clips]

    def _normalized(self, item: Item, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from apertus_plugins.core.chat import ChatFormatError, normalize_messages

        try:
            return normalize_messages(messages, self.ctx.spec)
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{item.name}: {exc}") from exc

    def load(self, ref: MediaRef, record: tuple[list[dict[str, Any]], str] | None = None) -> np.ndarray:
        """The preprocessed array of one media item (``record``: the normalized messages holding it inline)."""
        from apertus_plugins.core.media.audio import AudioError
        from apertus_plugins.core.media.image import ImageError

        data = read_media(ref, (lambda r: _inline(r, record)) if record else None)
        if not data:
            raise BadInput(Reasons.EMPTY, f"{ref.name}: the file is empty (zero bytes)")
        media = self.ctx.media
        if ref.kind == "image":
            try:
                return media.image(data)
            except (ImageError, OSError) as exc:
                raise BadInput(Reasons.IMAGE, f"{ref.name}: {strip_name(exc)}") from exc
        if ref.kind == "audio":
            try:
                return media.audio(data)
            except (AudioError, OSError) as exc:
                raise BadInput(Reasons.AUDIO, f"{ref.name}: {strip_name(exc)}") from exc
        mod = plugin_modality(ref.kind, "load")
        try:
            return np.asarray(mod.load(data))
        except (ValueError, OSError) as exc:
            raise BadInput(Reasons.MEDIA, f"{ref.name}: {strip_name(exc)}") from exc


def _inline(ref: MediaRef, record: tuple[list[dict[str, Any]], str]) -> bytes:
    messages, base = record
    mi, pi = ref.inline or (0, 0)
    _how, data = part_source(messages[mi]["content"]["parts"][pi], base, ref.name)
    return data


def strip_name(exc: BaseException) -> str:
    """The core's message without its leading ``<N bytes>: `` (the caller names the item)."""
    msg = str(exc)
    if msg.startswith("<") and ">: " in msg:
        return msg.split(">: ", 1)[1]
    return msg
