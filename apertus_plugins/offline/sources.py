"""Inputs of the offline pipeline: what items there are, and their post-preprocessing shapes from headers.

Nothing here decodes pixels or samples. An image's size (and EXIF orientation) comes from the
file header that Pillow reads on ``Image.open``; an audio clip's frame count and rate from the
header libsndfile reads in ``soundfile.info``. The core turns those into the exact shape the
preprocessing will produce (:func:`apertus_plugins.media.image.resized_size`,
:func:`apertus_plugins.media.audio.resampled_length`), which is what the planner groups by.

Inputs:

* pretraining: image files, audio files, folders of them (recursively, sorted by path; a ``.txt``
  with the same stem beside a media file is its caption or transcript), and WebDataset ``.tar``
  shards (members grouped into samples by key, the basename up to its first dot; one image or
  audio component per sample, an optional ``txt`` component);
* SFT: JSONL files (or folders of them), one conversation per line: ``{"messages": [...],
  "tools": [...], "enable_thinking": bool}`` or a bare list of messages, in the OpenAI or the
  Apertus shape; media parts name a file path (absolute, or relative to ``--media-root`` /
  the JSONL's folder), a ``file://`` URL or inline base64 data (a ``data:`` URL, or
  ``input_audio.data``).

Bad inputs never stop a run: each becomes a :class:`Skip` with a short reason and the source's
name; the summary report counts and lists them.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_EXTS", "AUDIO_EXTS", "MediaRef", "Item", "Skip", "Reasons", "BadInput", "RangeReader",
    "open_media", "read_media", "media_shape", "scan_pretrain", "scan_sft", "input_listing", "parse_record",
    "media_parts",
]

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
AUDIO_EXTS = frozenset({"wav", "flac", "ogg", "oga", "mp3", "opus", "aif", "aiff"})
TEXT_EXTS = frozenset({"txt"})


class Reasons:
    """The short reasons a skipped item is counted under (the detail names the problem)."""

    MISSING = "missing file"
    EMPTY = "empty file"
    IMAGE = "unreadable image"
    AUDIO = "unreadable audio"
    ASPECT = "aspect ratio above 200"
    IMAGE_SIZE = "invalid image size"
    FORMAT = "unsupported sample format"
    TAR = "unreadable tar shard"
    JSON = "invalid JSON"
    CONVERSATION = "invalid conversation"
    REMOTE = "remote media not fetched"
    TEXT = "unreadable text"
    NO_TRANSCRIPT = "no transcript"


class BadInput(ValueError):
    """An input that cannot become a document (it is skipped); ``reason`` is one of :class:`Reasons`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class MediaRef:
    """Where one media item's bytes are, and the shape its preprocessing gives.

    ``path`` is a media file, a tar shard (``offset``/``size``: the member's byte range) or, for
    inline base64 data, the JSONL file (``inline``: [message, part] of the record). ``shape`` is
    ``[height, width]`` after resizing, or ``[samples]`` at 24 kHz; ``codes`` the codes it costs.
    """

    kind: str
    path: str
    name: str
    offset: int = -1
    size: int = -1
    inline: list[int] | None = None
    shape: list[int] = field(default_factory=list)
    codes: int = 0


@dataclass
class Item:
    """One document to write: a media item (pretrain) or a conversation (sft), in source order."""

    index: int
    kind: str  # "image" | "audio" | "conversation"
    name: str
    media: list[MediaRef]
    text: str | None = None  # pretrain: caption or transcript
    record: list[Any] | None = None  # sft: [jsonl path, byte offset, byte length]

    @property
    def codes(self) -> int:
        return sum(m.codes for m in self.media)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Item:
        return cls(**{**d, "media": [MediaRef(**m) for m in d["media"]]})


@dataclass
class Skip:
    """An input left out of the output: its name, the short reason and the full message."""

    source: str
    reason: str
    detail: str


# ---------------------------------------------------------------------- byte access
class RangeReader(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes at ``offset`` of an open binary file (closed with it)."""

    def __init__(self, fh: Any, offset: int, size: int) -> None:
        super().__init__()
        self._fh, self._start, self._size, self._pos = fh, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._fh.close()
        super().close()

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._size - self._pos))
        if n == 0:
            return 0
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _data_url(value: str) -> bytes:
    head, _, payload = value.partition(",")
    if ";base64" not in head:
        raise BadInput(Reasons.FORMAT, "only base64 data: URLs are supported")
    return _b64(payload)


def _b64(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadInput(Reasons.FORMAT, f"inline media is not valid base64 ({exc})") from exc


def open_media(ref: MediaRef, inline_bytes: Callable[[MediaRef], bytes] | None = None) -> Any:
    """A binary file object over a media item's bytes (close it after use)."""
    if ref.inline is not None:
        if inline_bytes is None:
            raise BadInput(Reasons.FORMAT, f"{ref.name}: inline media needs its record")
        return io.BytesIO(inline_bytes(ref))
    try:
        fh = open(ref.path, "rb")  # noqa: SIM115 (returned to the caller)
    except FileNotFoundError as exc:
        raise BadInput(Reasons.MISSING, f"{ref.name}: no such file") from exc
    if ref.offset < 0:
        return fh
    return io.BufferedReader(RangeReader(fh, ref.offset, ref.size))


def read_media(ref: MediaRef, inline_bytes: Callable[[MediaRef], bytes] | None = None) -> bytes:
    """All bytes of a media item."""
    with open_media(ref, inline_bytes) as fh:
        return fh.read()


# ---------------------------------------------------------------------- headers
def _image_header(fh: Any) -> tuple[int, int]:
    """(height, width) as the decoded, EXIF-transposed image will have them, from the header."""
    from PIL import Image

    with Image.open(fh) as img:
        width, height = img.size
        try:
            orientation = int(img.getexif().get(0x0112, 1))  # EXIF Orientation
        except Exception:  # noqa: BLE001 (a broken EXIF block leaves the image upright)
            orientation = 1
    if orientation in (5, 6, 7, 8):  # the transposing orientations swap the sides
        height, width = width, height
    return height, width


def media_shape(ref: MediaRef, resize_policy: str, audio_policy: str,
                inline_bytes: Callable[[MediaRef], bytes] | None = None) -> None:
    """Fill ``ref.shape`` and ``ref.codes`` from the item's header; raise :class:`BadInput`."""
    from ..media.audio import AudioError, audio_code_count, resampled_length
    from ..media.image import MAX_ASPECT, PATCH, ImageError, resized_size

    if ref.inline is None and ref.offset < 0:
        if not os.path.isfile(ref.path):
            raise BadInput(Reasons.MISSING, f"{ref.name}: no such file")
        size = os.path.getsize(ref.path)
    else:
        size = ref.size
    if size == 0:
        raise BadInput(Reasons.EMPTY, f"{ref.name}: the file is empty (zero bytes)")
    with open_media(ref, inline_bytes) as fh:
        src = ref.path if ref.inline is None and ref.offset < 0 else fh  # a path keeps messages short
        if ref.kind == "image":
            try:
                h, w = _image_header(src)
            except Exception as exc:  # noqa: BLE001 (any header parse failure is bad input)
                raise BadInput(Reasons.IMAGE, f"{ref.name}: not a readable image ({exc})") from exc
            try:
                rh, rw = resized_size(h, w, resize_policy)
            except ImageError as exc:
                ratio = max(h, w) / max(min(h, w), 1)
                reason = Reasons.ASPECT if min(h, w) > 0 and ratio > MAX_ASPECT else Reasons.IMAGE_SIZE
                raise BadInput(reason, f"{ref.name}: {exc}") from exc
            ref.shape = [rh, rw]
            ref.codes = (rh // PATCH) * (rw // PATCH)
        elif ref.kind == "audio":
            import soundfile as sf

            try:
                info = sf.info(src)
            except Exception as exc:  # noqa: BLE001
                raise BadInput(Reasons.AUDIO, f"{ref.name}: not a readable audio file ({exc})") from exc
            try:
                n = resampled_length(int(info.frames), int(info.samplerate), audio_policy)
            except AudioError as exc:
                raise BadInput(Reasons.AUDIO, f"{ref.name}: {exc}") from exc
            ref.shape = [n]
            ref.codes = audio_code_count(n)
        else:
            raise BadInput(Reasons.FORMAT, f"{ref.name}: no planner for modality {ref.kind!r}")


# ---------------------------------------------------------------------- pretraining inputs
def _ext(name: str) -> str:
    """The extension of a file name, or the media type of a WebDataset component (``seg.jpg`` -> ``jpg``)."""
    return name.rsplit(".", 1)[-1].lower()


def _kind_of(ext: str) -> str | None:
    if ext in IMAGE_EXTS:
        return "image"
    if ext in AUDIO_EXTS:
        return "audio"
    return None


def _walk(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: no such file or folder")
    files = []
    for root, dirs, names in os.walk(source):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(Path(root) / n for n in names if not n.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(source).as_posix())


def _read_text(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise BadInput(Reasons.TEXT, f"{name}: text is not UTF-8 ({exc})") from exc


def scan_pretrain(sources: list[str], resize_policy: str, audio_policy: str,
                  tick: Callable[[int], None] = lambda n: None) -> tuple[list[Item], list[Skip], list[str]]:
    """Items (media with their shapes), skips and the files read, in source order."""
    items: list[Item] = []
    skips: list[Skip] = []
    files_read: list[str] = []

    def add(ref: MediaRef, text: str | None) -> None:
        try:
            media_shape(ref, resize_policy, audio_policy)
        except BadInput as exc:
            skips.append(Skip(ref.name, exc.reason, exc.detail))
            return
        items.append(Item(len(items), ref.kind, ref.name, [ref], text))

    for src in sources:
        root = Path(src)
        files = _walk(root)
        stems = {(f.parent, f.name.rsplit(".", 1)[0]) for f in files if _kind_of(_ext(f.name))}
        for f in files:
            files_read.append(str(f.resolve()))
            ext = _ext(f.name) if "." in f.name else ""
            kind = _kind_of(ext)
            path = str(f.resolve())
            if kind:
                text = None
                side = f.with_name(f.name.rsplit(".", 1)[0] + ".txt")
                if side.is_file():
                    try:
                        text = _read_text(side.read_bytes(), str(side))
                    except BadInput as exc:
                        skips.append(Skip(str(f), exc.reason, exc.detail))
                        continue
                add(MediaRef(kind, path, str(f)), text)
            elif ext == "tar":
                _scan_tar(f, add, skips)
            elif ext in TEXT_EXTS and (f.parent, f.name.rsplit(".", 1)[0]) in stems:
                continue  # a caption or transcript beside its media file
            elif f.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
                skips.append(Skip(str(f), Reasons.FORMAT, f"{f}: compressed tar shards are not supported "
                                  "(items are read by byte offset; use plain .tar WebDataset shards)"))
            else:
                skips.append(Skip(str(f), Reasons.FORMAT, f"{f}: not an image, audio file or .tar shard "
                                  f"(extension {ext or 'none'!r})"))
            tick(1)
    return items, skips, files_read


def _scan_tar(path: Path, add: Callable[[MediaRef, str | None], None], skips: list[Skip]) -> None:
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                d, base = posixpath.split(m.name)
                if base.startswith("."):
                    continue
                key, _, ext = base.partition(".")
                samples.setdefault(posixpath.join(d, key), {})[ext.lower()] = m
    except (tarfile.TarError, OSError, EOFError) as exc:
        skips.append(Skip(str(path), Reasons.TAR, f"{path}: not a readable (uncompressed) tar shard, "
                          f"{len(samples)} samples read before the error ({exc})"))
    with open(path, "rb") as fh:
        for key, parts in samples.items():
            name = f"{path}:{key}"
            media = {e: m for e, m in parts.items() if _kind_of(_ext(e))}
            if len(media) != 1:
                what = "no image or audio component" if not media else f"{len(media)} media components"
                skips.append(Skip(name, Reasons.FORMAT, f"{name}: {what} (components: {', '.join(sorted(parts))})"))
                continue
            (ext, m), = media.items()
            text = None
            if "txt" in parts:
                t = parts["txt"]
                fh.seek(t.offset_data)
                try:
                    text = _read_text(fh.read(t.size), f"{name}.txt")
                except BadInput as exc:
                    skips.append(Skip(name, exc.reason, exc.detail))
                    continue
            add(MediaRef(_kind_of(_ext(ext)) or "", str(path.resolve()), f"{name}.{ext}", m.offset_data, m.size), text)


# ---------------------------------------------------------------------- SFT inputs
def parse_record(line: bytes, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool | None]:
    """(messages, tools, enable_thinking or None) of one JSONL line; :class:`BadInput` if unusable."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(Reasons.JSON, f"{name}: not valid JSON ({exc})") from exc
    if isinstance(obj, list):
        return obj, None, None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
        raise BadInput(Reasons.FORMAT, f"{name}: expected an object with a 'messages' list or a list of "
                             f"messages, got {keys}")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadInput(Reasons.FORMAT, f"{name}: 'tools' must be a list")
    thinking = obj.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadInput(Reasons.FORMAT, f"{name}: 'enable_thinking' must be true or false")
    return obj["messages"], tools, thinking


def media_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, str, dict[str, Any]]]:
    """``(message, part, modality, part)`` of every media part of normalized messages, in rendering order.

    The modality of a part type comes from the plugin registry, so a registered modality's parts
    are found the same way as the built-in image and audio parts.
    """
    from ..plugins import registry

    reg = registry()
    for mi, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, dict) and "parts" in content:
            for pi, part in enumerate(content["parts"]):
                mod = reg.modality_for_part(part.get("type", "")) if isinstance(part, dict) else None
                if mod is not None:
                    yield mi, pi, mod.name, part


def _part_value(part: dict[str, Any]) -> Any:
    t = part.get("type")
    for key in (t, "path", "file", "url", "data", "image_url", "audio_url", "input_audio", "image", "audio"):
        if key and part.get(key) is not None:
            return part[key]
    return None


def part_source(part: dict[str, Any], base: Path, name: str) -> tuple[str, Any]:
    """``("path", absolute path)`` or ``("data", bytes)`` of a media part; raises :class:`BadInput`."""
    value = _part_value(part)
    if isinstance(value, dict):
        if isinstance(value.get("data"), str):
            data = value["data"]
            return ("data", _data_url(data) if data.startswith("data:") else _b64(data))
        value = value.get("path") or value.get("url") or value.get("file")
    if not isinstance(value, str) or not value:
        raise BadInput(Reasons.FORMAT, f"{name}: the {part.get('type')!r} part names no file or data")
    if value.startswith("data:"):
        return ("data", _data_url(value))
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif "://" in value:
        raise BadInput(Reasons.REMOTE, f"{name}: {value[:80]!r} is a remote URL; the pipeline reads local "
                             "files only (download first)")
    p = Path(value)
    return ("path", str((p if p.is_absolute() else base / p).resolve()))


def scan_sft(sources: list[str], media_root: str | None, resize_policy: str, audio_policy: str,
             tick: Callable[[int], None] = lambda n: None) -> tuple[list[Item], list[Skip], list[str]]:
    """Conversations (with their media's shapes), skips and the files read, in source order."""
    from ..chat.template import ChatFormatError, normalize_messages

    items: list[Item] = []
    skips: list[Skip] = []
    files_read: list[str] = []
    for src in sources:
        for f in _walk(Path(src)):
            if _ext(f.name) not in ("jsonl", "json") and Path(src).is_dir():
                continue
            path = str(f.resolve())
            files_read.append(path)
            base = Path(media_root).resolve() if media_root else f.resolve().parent
            with open(f, "rb") as fh:
                offset = 0
                for lineno, raw in enumerate(fh, 1):
                    start, offset = offset, offset + len(raw)
                    if not raw.strip():
                        continue
                    name = f"{f}:{lineno}"
                    tick(1)
                    try:
                        messages, _tools, _thinking = parse_record(raw, name)
                        try:
                            norm = normalize_messages(messages)
                        except ChatFormatError as exc:
                            raise BadInput(Reasons.CONVERSATION, f"{name}: {exc}") from exc
                        refs = []
                        for mi, pi, kind, part in media_parts(norm):
                            where = f"{name} message {mi} part {pi}"
                            how, value = part_source(part, base, where)
                            if how == "path":
                                ref = MediaRef(kind, value, f"{value} ({where})")
                                if value not in files_read:
                                    files_read.append(value)
                                media_shape(ref, resize_policy, audio_policy)
                            else:
                                ref = MediaRef(kind, path, where, size=len(value), inline=[mi, pi])
                                media_shape(ref, resize_policy, audio_policy, lambda _r, v=value: v)
                            refs.append(ref)
                    except BadInput as exc:
                        skips.append(Skip(name, exc.reason, exc.detail))
                        continue
                    items.append(Item(len(items), "conversation", name, refs, record=[path, start, len(raw)]))
    return items, skips, files_read


def input_listing(files: list[str]) -> list[list[Any]]:
    """``[path, size, mtime_ns]`` of every input file (a resumed run checks that none changed)."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append([f, st.st_size, st.st_mtime_ns])
        except FileNotFoundError:
            out.append([f, -1, -1])
    return out
