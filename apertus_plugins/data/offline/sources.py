"""Inputs of the offline pipeline: what items there are, and their post-preprocessing shapes from headers.

Nothing here decodes pixels or samples. An image's size (and EXIF orientation) comes from the
file header that Pillow reads on ``Image.open``; an audio clip's frame count and rate from the
header libsndfile reads in ``soundfile.info``. The core turns those into the exact shape the
preprocessing will produce (:func:`apertus_plugins.core.media.image.resized_size`,
:func:`apertus_plugins.core.media.audio.resampled_length`), which is what the planner groups by.

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

Planning shards (:func:`list_shards`): the inputs are cut, in source order, into shards that
planning tasks scan independently (:func:`scan_shard`): a WebDataset ``.tar`` is one shard, the
files of a folder are cut into shards of ``plan_files`` files, a JSONL file into byte ranges of
``plan_bytes`` (a range holds the lines that start in it; a quick count of the lines before it
keeps every conversation's ``file:line`` name). A shard's spec lists each file it covers with
its size and modification stamp; a resumed run lists the inputs again and compares. Every path
may be a URL of any fsspec filesystem (:mod:`.storage`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import storage
from .preprocess import MediaSettings

__all__ = [
    "IMAGE_EXTS", "AUDIO_EXTS", "MediaRef", "Item", "Skip", "Reasons", "BadInput", "RangeReader", "ShardScan", "unexpected",
    "open_media", "read_media", "media_shape", "list_shards", "line_starts", "scan_shard", "scan_pretrain",
    "scan_sft", "parse_record", "media_parts", "part_source", "media_base", "RecordingClip", "parse_recording",
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
    MEDIA = "unreadable media"
    ASPECT = "aspect ratio above 200"
    IMAGE_SIZE = "invalid image size"
    LIMIT = "above a media limit"  # refused from its header (--media-limit NAME=VALUE moves the limit)
    FORMAT = "unsupported sample format"
    TAR = "unreadable tar shard"
    JSON = "invalid JSON"
    CONVERSATION = "invalid conversation"
    RECORDING = "invalid recording"  # an interleaved run's line: no clips, a clip without audio
    REMOTE = "remote media not fetched"
    TEXT = "unreadable text"
    NO_TRANSCRIPT = "no transcript"
    PADDED = "no codes left after padding"  # --audio-batching report: a padded clip of at most five codes
    ENCODER = "encoder failed"  # the encoder raised on the item alone (its batch is encoded without it)
    CRASH = "worker crashed"  # its worker process died on it, twice (a crashing decoder, out of memory)
    ERROR = "unexpected error"  # anything else an item raised (the detail names the stage and the error)


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
    kind: str  # "image" | "audio" | "conversation" | "recording" (interleaved: its clips, in order)
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
    """An input left out of the output: its name, the short reason, the full message and the stage
    that found it (``plan``: its header; ``decode``: its bytes; ``encode``: the encoder; ``document``:
    building its ids)."""

    source: str
    reason: str
    detail: str
    stage: str = ""


def unexpected(name: str, stage: str, exc: BaseException, media: str | None = None) -> Skip:
    """The skip of an item whose ``stage`` raised something no rule expects (it costs only that item);
    ``media``: the item's media part that raised, when it is not the item itself."""
    where = f"{name}: {media}" if media and media != name else name
    return Skip(name, Reasons.ERROR, f"{where}: {_WHILE[stage]}: {type(exc).__name__}: {exc}", stage)


_WHILE = {"plan": "reading its header", "decode": "decoding and preprocessing it", "encode": "encoding it",
          "document": "building its document"}


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
        fh = storage.open_read(ref.path)
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
def _png_exif(fp: Any) -> bytes | None:
    """The ``eXIf`` chunk of a PNG wherever it is, found by walking the chunk headers (no pixel decoded)."""
    fp.seek(8)  # the signature
    while True:
        head = fp.read(8)
        if len(head) < 8:
            return None
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        if kind == b"eXIf":
            return fp.read(length)
        if kind == b"IEND":
            return None
        fp.seek(length + 4, 1)  # the data and its CRC


def _image_header(fh: Any) -> tuple[int, int]:
    """(height, width) as the decoded, EXIF-transposed image will have them, from the header.

    Nothing is decoded: Pillow's ``getexif`` of a PNG without an ``eXIf`` chunk before its pixels
    decodes the whole image to look for one after them, so for PNGs the chunks are walked instead.
    """
    from PIL import Image

    with Image.open(fh) as img:
        width, height = img.size
        try:
            if img.format == "PNG" and "exif" not in img.info:
                data = _png_exif(img.fp)
                exif = Image.Exif()
                if data:
                    exif.load(data)
            else:
                exif = img.getexif()
            orientation = int(exif.get(0x0112, 1))  # EXIF Orientation
        except Exception:  # noqa: BLE001 (a broken EXIF block leaves the image upright)
            orientation = 1
    if orientation in (5, 6, 7, 8):  # the transposing orientations swap the sides
        height, width = width, height
    return height, width


def media_shape(ref: MediaRef, media: MediaSettings, inline_bytes: Callable[[MediaRef], bytes] | None = None) -> None:
    """Fill ``ref.shape`` and ``ref.codes`` from the item's header; raise :class:`BadInput`."""
    from apertus_plugins.core.media.audio import AudioError, audio_code_count
    from apertus_plugins.core.media.image import MAX_ASPECT, PATCH, ImageError

    if ref.inline is None and ref.offset < 0:
        size = storage.stamp(ref.path)[0]
        if size < 0 or not storage.isfile(ref.path):
            raise BadInput(Reasons.MISSING, f"{ref.name}: no such file")
    else:
        size = ref.size
    if size == 0:
        raise BadInput(Reasons.EMPTY, f"{ref.name}: the file is empty (zero bytes)")
    with open_media(ref, inline_bytes) as fh:
        # a local path keeps the decoders' messages short
        src = ref.path if ref.inline is None and ref.offset < 0 and storage.is_local(ref.path) else fh
        if ref.kind == "image":
            try:
                h, w = _image_header(src)
            except Exception as exc:  # noqa: BLE001 (any header parse failure is bad input)
                raise BadInput(Reasons.IMAGE, f"{ref.name}: not a readable image ({exc})") from exc
            try:
                media.check_image(h, w, ref.name)
            except ImageError as exc:
                raise BadInput(Reasons.LIMIT, str(exc)) from exc
            try:
                rh, rw = media.image_size(h, w)
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
                media.check_audio(int(info.frames), int(info.samplerate), int(info.channels), ref.name)
            except AudioError as exc:
                raise BadInput(Reasons.LIMIT, str(exc)) from exc
            try:
                n = media.audio_length(int(info.frames), int(info.samplerate))
            except AudioError as exc:
                raise BadInput(Reasons.AUDIO, f"{ref.name}: {exc}") from exc
            ref.shape = [n]
            ref.codes = audio_code_count(n)
        else:
            mod = plugin_modality(ref.kind, "probe")
            try:
                shape, codes = mod.probe(fh.read())
            except (ValueError, OSError) as exc:
                raise BadInput(Reasons.MEDIA, f"{ref.name}: not a readable {ref.kind} item ({exc})") from exc
            ref.shape = [int(x) for x in shape]
            ref.codes = int(codes)


def plugin_modality(kind: str, need: str) -> Any:
    """The registered modality ``kind`` (a plugin's), which must provide ``need`` (``probe``, ``load``,
    ``tokenizer_factory``); raises :class:`BadInput` naming what is missing."""
    from apertus_plugins.plugins import registry

    mod = registry().modalities.get(kind)
    if mod is None:
        raise BadInput(Reasons.FORMAT, f"no registered modality {kind!r}")
    if getattr(mod, need) is None:
        raise BadInput(Reasons.FORMAT, f"the {kind} modality (a plugin's) gives no {need}: the offline "
                                       f"pipeline needs its probe, load and tokenizer_factory")
    return mod


# ---------------------------------------------------------------------- names
def _ext(name: str) -> str:
    """The extension of a file name, or the media type of a WebDataset component (``seg.jpg`` -> ``jpg``)."""
    return name.rsplit(".", 1)[-1].lower()


def _kind_of(ext: str) -> str | None:
    if ext in IMAGE_EXTS:
        return "image"
    if ext in AUDIO_EXTS:
        return "audio"
    return None


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0]


@lru_cache(maxsize=64)
def _media_stems(names: frozenset[str]) -> frozenset[str]:
    """Stems of the media files among a folder's file names (their ``.txt`` twins are captions)."""
    return frozenset(_stem(n) for n in names if _kind_of(_ext(n)))


def _display(source: str, rel: str, path: str) -> str:
    """The name of a file in messages and the report: the source as given joined with the file's relative path."""
    if not storage.is_local(source):
        return path
    src = storage.local_path(source)
    return str(Path(src) / rel) if rel else str(Path(src))


def _resolved(path: str) -> str:
    return str(Path(path).resolve()) if storage.is_local(path) else path


def _read_text(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise BadInput(Reasons.TEXT, f"{name}: text is not UTF-8 ({exc})") from exc


def media_base(jsonl_path: str, media_root: str | None) -> str:
    """The folder relative media paths of a JSONL file are resolved against."""
    if media_root:
        return _resolved(storage.local_path(media_root)) if storage.is_local(media_root) else media_root
    return storage.parent(jsonl_path)


# ---------------------------------------------------------------------- shards
_COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def list_shards(kind: str, sources: list[str], plan_files: int, plan_bytes: int) -> Iterator[dict[str, Any]]:
    """The planning shards of the inputs, in source order (see the module docstring).

    Specs are JSON-ready dicts: ``{"kind": "files", "files": [[path, name, [size, stamp], role,
    caption path or None], ...]}`` (role: ``image``, ``audio``, ``caption``, ``compressed`` or
    ``other``), ``{"kind": "tar", "path", "name", "stamp"}`` or ``{"kind": "jsonl", "path", "name",
    "stamp", "range": [start, end], "part", "parts"}``. Only one folder's listing is held at a time.
    """
    if kind == "pretrain":
        yield from _pretrain_shards(sources, plan_files)
    elif kind == "interleaved":  # JSONL of recordings, cut as the conversations of an sft run
        for spec in _sft_shards(sources, plan_bytes):
            yield dict(spec, mode="recordings")
    else:
        yield from _sft_shards(sources, plan_bytes)


def _pretrain_shards(sources: list[str], plan_files: int) -> Iterator[dict[str, Any]]:
    for src in sources:
        buf: list[list[Any]] = []
        for path, rel, st, names in storage.walk_files(src):
            fname = storage.name_of(path)
            name = _display(src, rel, path)
            ext = _ext(fname) if "." in fname else ""
            kind = _kind_of(ext)
            resolved = _resolved(path)
            if ext == "tar" and not kind:
                if buf:
                    yield {"kind": "files", "files": buf}
                    buf = []
                yield {"kind": "tar", "path": resolved, "name": name, "stamp": st}
                continue
            caption = None
            if kind:
                side = _stem(fname) + ".txt"
                has = side in names if names is not None else storage.isfile(storage.join(storage.parent(path), side))
                caption = _resolved(storage.join(storage.parent(path), side)) if has else None
                role = kind
            elif ext == "txt" and names is not None and _stem(fname) in _media_stems(names):
                role = "caption"  # a caption or transcript beside its media file
            elif fname.endswith(_COMPRESSED):
                role = "compressed"
            else:
                role = "other"
            buf.append([resolved, name, st, role, caption])
            if len(buf) >= plan_files:
                yield {"kind": "files", "files": buf}
                buf = []
        if buf:
            yield {"kind": "files", "files": buf}


def _sft_shards(sources: list[str], plan_bytes: int) -> Iterator[dict[str, Any]]:
    for src in sources:
        folder = storage.isdir(src)
        for path, rel, st, _names in storage.walk_files(src):
            if folder and _ext(storage.name_of(path)) not in ("jsonl", "json"):
                continue
            size = max(0, int(st[0]))
            parts = max(1, -(-size // plan_bytes))
            for k in range(parts):
                yield {"kind": "jsonl", "path": _resolved(path), "name": _display(src, rel, path), "stamp": st,
                       "range": [k * plan_bytes, min(size, (k + 1) * plan_bytes)], "part": k, "parts": parts}


def shard_files(spec: dict[str, Any]) -> list[str]:
    """The input files a shard's spec names (the files its planning task may read, captions included)."""
    if spec["kind"] == "files":
        return [f[0] for f in spec["files"]] + [f[4] for f in spec["files"] if f[4]]
    return [spec["path"]]


def line_starts(path: str, start: int, end: int, block: int = 1 << 22) -> int:
    """How many lines of a file start at a byte in ``[start, end)`` (a line starts at 0 and after each newline)."""
    total = 1 if start == 0 and end > 0 else 0
    lo, hi = max(start - 1, 0), end - 1
    if hi <= lo:
        return total
    with storage.open_read(path) as fh:
        fh.seek(lo)
        left = hi - lo
        while left > 0:
            data = fh.read(min(block, left))
            if not data:
                break
            total += data.count(b"\n")
            left -= len(data)
    return total


@dataclass
class ShardScan:
    """What a planning task found in its shard besides the items: skips, referenced files, what it read."""

    skips: list[Skip] = field(default_factory=list)
    referenced: list[list[Any]] = field(default_factory=list)  # sft: media files named by conversations
    read: list[str] = field(default_factory=list)
    media: dict[str, int] = field(default_factory=dict)
    items: int = 0


def scan_shard(spec: dict[str, Any], media: MediaSettings, media_root: str | None,
               emit: Callable[[Item], None]) -> ShardScan:
    """Plan one shard from headers: ``emit`` each item (indices local to the shard), return the rest.

    Whatever one item raises (a header no rule expects, an unreadable caption) skips that item only.
    """
    out = ShardScan()
    reads: dict[str, None] = {}

    def add(item: Item) -> None:
        item.index = out.items
        out.items += 1
        for m in item.media:
            out.media[m.kind] = out.media.get(m.kind, 0) + 1
        emit(item)

    def read(path: str) -> None:
        reads.setdefault(path)

    if spec["kind"] == "files":
        _scan_files(spec, media, add, out.skips, read)
    elif spec["kind"] == "tar":
        read(spec["path"])
        _scan_tar(spec["path"], spec["name"], media, add, out.skips)
    elif spec["kind"] == "jsonl" and spec.get("mode") == "recordings":
        read(spec["path"])
        _scan_recordings(spec, media_root, media, add, out, read)
    elif spec["kind"] == "jsonl":
        read(spec["path"])
        _scan_jsonl(spec, media_root, media, add, out, read)
    else:
        raise ValueError(f"unknown shard kind {spec['kind']!r}")
    out.read = list(reads)
    return out


def _shaped(ref: MediaRef, text: str | None, media: MediaSettings, add: Callable[[Item], None],
            skips: list[Skip]) -> None:
    try:
        media_shape(ref, media)
    except BadInput as exc:
        skips.append(Skip(ref.name, exc.reason, exc.detail, "plan"))
        return
    except Exception as exc:  # noqa: BLE001 (one item's failure costs only that item)
        skips.append(unexpected(ref.name, "plan", exc))
        return
    add(Item(0, ref.kind, ref.name, [ref], text))


def _scan_files(spec: dict[str, Any], media: MediaSettings, add: Callable[[Item], None], skips: list[Skip],
                read: Callable[[str], None]) -> None:
    for path, name, _st, role, caption in spec["files"]:
        if role in ("image", "audio"):
            text = None
            if caption:
                read(caption)
                try:
                    text = _read_text(storage.read_bytes(caption),
                                      storage.join(storage.parent(name), _stem(storage.name_of(name)) + ".txt"))
                except BadInput as exc:
                    skips.append(Skip(name, exc.reason, exc.detail, "plan"))
                    continue
                except OSError as exc:  # a caption that cannot be read (permissions, a vanished file)
                    skips.append(Skip(name, Reasons.TEXT, f"{name}: its caption {caption} cannot be read ({exc})",
                                      "plan"))
                    continue
            read(path)
            _shaped(MediaRef(role, path, name), text, media, add, skips)
        elif role == "caption":
            continue
        elif role == "compressed":
            skips.append(Skip(name, Reasons.FORMAT, f"{name}: compressed tar shards are not supported "
                              "(items are read by byte offset; use plain .tar WebDataset shards)", "plan"))
        else:
            fname = storage.name_of(name)
            ext = _ext(fname) if "." in fname else ""
            skips.append(Skip(name, Reasons.FORMAT, f"{name}: not an image, audio file or .tar shard "
                              f"(extension {ext or 'none'!r})", "plan"))


def _scan_tar(path: str, name: str, media: MediaSettings, add: Callable[[Item], None], skips: list[Skip]) -> None:
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with storage.open_read(path) as fh, tarfile.open(fileobj=fh, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                d, base = posixpath.split(m.name)
                if base.startswith("."):
                    continue
                key, _, ext = base.partition(".")
                samples.setdefault(posixpath.join(d, key), {})[ext.lower()] = m
    except (tarfile.TarError, OSError, EOFError) as exc:
        skips.append(Skip(name, Reasons.TAR, f"{name}: not a readable (uncompressed) tar shard, "
                          f"{len(samples)} samples read before the error ({exc})", "plan"))
    with storage.open_read(path) as fh:
        for key, parts in samples.items():
            sample = f"{name}:{key}"
            found = {e: m for e, m in parts.items() if _kind_of(_ext(e))}
            if len(found) != 1:
                what = "no image or audio component" if not found else f"{len(found)} media components"
                skips.append(Skip(sample, Reasons.FORMAT, f"{sample}: {what} (components: {', '.join(sorted(parts))})",
                                  "plan"))
                continue
            (ext, m), = found.items()
            text = None
            if "txt" in parts:
                t = parts["txt"]
                fh.seek(t.offset_data)
                try:
                    text = _read_text(fh.read(t.size), f"{sample}.txt")
                except BadInput as exc:
                    skips.append(Skip(sample, exc.reason, exc.detail, "plan"))
                    continue
            _shaped(MediaRef(_kind_of(_ext(ext)) or "", path, f"{sample}.{ext}", m.offset_data, m.size), text,
                    media, add, skips)


def _lines(fh: Any, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of the lines of an open file that start in ``[start, end)``."""
    pos = start
    if start > 0:
        fh.seek(start - 1)
        if fh.read(1) != b"\n":  # the line under ``start`` began in the previous range
            pos += len(fh.readline())
    else:
        fh.seek(0)
    while pos < end:
        raw = fh.readline()
        if not raw:
            return
        yield pos, raw
        pos += len(raw)


def _scan_records(spec: dict[str, Any], media_root: str | None, media: MediaSettings, add: Callable[[Item], None],
                  out: ShardScan, read: Callable[[str], None], item_kind: str,
                  refs_of: Callable[[bytes, str, str, Callable[[str, str, str], MediaRef]], list[MediaRef]]) -> None:
    """Plan the records of a JSONL range, one item (``item_kind``) per line: ``refs_of(raw, name, base,
    file_ref)`` gives a line's media; ``file_ref(kind, path, where)`` references a media file (its stamp
    noted and its header read once per shard). A bad line, or a bad medium of it, skips that line only."""
    path, display = spec["path"], spec["name"]
    base = media_base(path, media_root)
    seen: set[str] = set()

    def file_ref(kind: str, value: str, where: str) -> MediaRef:
        ref = MediaRef(kind, value, f"{value} ({where})")
        if value not in seen:
            seen.add(value)
            out.referenced.append([value, *storage.stamp(value)])
            read(value)
        media_shape(ref, media)
        return ref

    lineno = int(spec.get("first_line", 1)) - 1
    start, end = spec["range"]
    with storage.open_read(path) as fh:
        for offset, raw in _lines(fh, start, end):
            lineno += 1
            if not raw.strip():
                continue
            name = f"{display}:{lineno}"
            try:
                refs = refs_of(raw, name, base, file_ref)
            except BadInput as exc:
                out.skips.append(Skip(name, exc.reason, exc.detail, "plan"))
                continue
            except Exception as exc:  # noqa: BLE001 (one record's failure costs only that record)
                out.skips.append(unexpected(name, "plan", exc))
                continue
            add(Item(0, item_kind, name, refs, record=[path, offset, len(raw)]))


def _scan_jsonl(spec: dict[str, Any], media_root: str | None, media: MediaSettings, add: Callable[[Item], None],
                out: ShardScan, read: Callable[[str], None]) -> None:
    """Plan the conversations of a JSONL range (``apertus tokenize sft``): one item per line."""
    from apertus_plugins.core.chat.template import ChatFormatError, normalize_messages
    from apertus_plugins.plugins import spec as registered_spec

    kinds = registered_spec()  # the installed modalities' part types
    path = spec["path"]

    def refs_of(raw: bytes, name: str, base: str, file_ref: Callable[[str, str, str], MediaRef]) -> list[MediaRef]:
        messages, _tools, _thinking = parse_record(raw, name)
        try:
            norm = normalize_messages(messages, kinds)
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{name}: {exc}") from exc
        refs = []
        for mi, pi, kind, part in media_parts(norm):
            where = f"{name} message {mi} part {pi}"
            how, value = part_source(part, base, where)
            if how == "path":
                refs.append(file_ref(kind, value, where))
            else:
                ref = MediaRef(kind, path, where, size=len(value), inline=[mi, pi])
                media_shape(ref, media, lambda _r, v=value: v)
                refs.append(ref)
        return refs

    _scan_records(spec, media_root, media, add, out, read, "conversation", refs_of)


def _scan_recordings(spec: dict[str, Any], media_root: str | None, media: MediaSettings,
                     add: Callable[[Item], None], out: ShardScan, read: Callable[[str], None]) -> None:
    """Plan the recordings of a JSONL range (``apertus tokenize interleaved``, :mod:`.interleaved`): one
    item per line, its clips as media with their header shapes; a bad line or clip skips the line."""

    def refs_of(raw: bytes, name: str, base: str, file_ref: Callable[[str, str, str], MediaRef]) -> list[MediaRef]:
        refs = []
        for k, clip in enumerate(parse_recording(raw, name)):
            where = f"{name} clip {k}"
            how, value = part_source({"type": "audio", "audio": clip.audio}, base, where)
            if how != "path":
                raise BadInput(Reasons.RECORDING, f"{where}: name the clip's audio file (inline data is "
                               "not read in recordings)")
            refs.append(file_ref("audio", value, where))
        return refs

    _scan_records(spec, media_root, media, add, out, read, "recording", refs_of)


# ---------------------------------------------------------------------- in one process
def _scan_all(kind: str, sources: list[str], media_root: str | None, media: MediaSettings,
              tick: Callable[[int], None]) -> tuple[list[Item], list[Skip], list[str]]:
    items: list[Item] = []
    skips: list[Skip] = []
    files: dict[str, None] = {}
    specs = list(list_shards(kind, sources, 1 << 30, 1 << 62))
    for spec in specs:
        def emit(it: Item) -> None:
            it.index = len(items)
            items.append(it)

        found = scan_shard(spec, media, media_root, emit)
        skips.extend(found.skips)
        for f in shard_files(spec) if spec["kind"] != "files" else [f[0] for f in spec["files"]]:
            files.setdefault(f)
        for ref in found.referenced:
            files.setdefault(ref[0])
        tick(len(spec["files"]) if spec["kind"] == "files" else 1)
    return items, skips, list(files)


def scan_pretrain(sources: list[str], resize_policy: str, audio_policy: str,
                  tick: Callable[[int], None] = lambda n: None) -> tuple[list[Item], list[Skip], list[str]]:
    """Every item (media with their shapes), skip and input file of pretraining sources, in source order.

    All in this process and in memory: the pipeline plans shard by shard (:func:`scan_shard`).
    """
    return _scan_all("pretrain", sources, None, MediaSettings(resize_policy, audio_policy), tick)


def scan_sft(sources: list[str], media_root: str | None, resize_policy: str, audio_policy: str,
             tick: Callable[[int], None] = lambda n: None) -> tuple[list[Item], list[Skip], list[str]]:
    """Every conversation (with its media's shapes), skip and file read of SFT sources, in source order."""
    return _scan_all("sft", sources, media_root, MediaSettings(resize_policy, audio_policy), tick)


# ---------------------------------------------------------------------- interleaved recordings
@dataclass(frozen=True)
class RecordingClip:
    """One clip of a recording as the input names it: its audio (path or URL as written) and transcript."""

    audio: str
    text: str


def parse_recording(line: bytes, name: str) -> list[RecordingClip]:
    """The clips of one JSONL line; raises :class:`~.sources.BadInput` naming the line and the clip."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(Reasons.JSON, f"{name}: not valid JSON ({exc})") from exc
    clips = obj.get("clips") if isinstance(obj, dict) else None
    if not isinstance(clips, list) or not clips:
        keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
        raise BadInput(Reasons.RECORDING, f"{name}: expected an object with a non-empty 'clips' list, got {keys}")
    out: list[RecordingClip] = []
    for k, clip in enumerate(clips):
        if not isinstance(clip, dict):
            raise BadInput(Reasons.RECORDING, f"{name} clip {k}: expected an object with 'audio' and 'text'")
        audio, text = clip.get("audio"), clip.get("text")
        if not isinstance(audio, str) or not audio:
            raise BadInput(Reasons.RECORDING, f"{name} clip {k}: 'audio' must name a file")
        if not isinstance(text, str) or not text.strip():
            raise BadInput(Reasons.NO_TRANSCRIPT, f"{name} clip {k} ({audio}): the transcript is empty")
        out.append(RecordingClip(audio, text))
    return out


# ---------------------------------------------------------------------- SFT records
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
    from apertus_plugins.plugins import registry

    reg = registry()
    for mi, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, dict) and "parts" in content:
            for pi, part in enumerate(content["parts"]):
                mod = reg.modality_for_part(part.get("type", "")) if isinstance(part, dict) else None
                if mod is not None:
                    yield mi, pi, mod.name, part


def _part_value(part: dict[str, Any]) -> Any:
    """The value naming a media part's file or data: under its own type's key, a generic key, or
    another registered part type's key (``{"type": "image", "image_url": ...}``)."""
    from apertus_plugins.plugins import registry

    t = part.get("type")
    others = (pt for m in registry().modalities.values() for pt in m.part_types)
    for key in (t, "path", "file", "url", "data", *others):
        if key and part.get(key) is not None:
            return part[key]
    return None


def part_source(part: dict[str, Any], base: str | Path, name: str) -> tuple[str, Any]:
    """``("path", absolute path or URL)`` or ``("data", bytes)`` of a media part; raises :class:`BadInput`.

    A relative path is resolved against ``base`` (a local folder, or a folder URL of the JSONL's
    filesystem); ``file://`` URLs are local files; other URLs are not fetched.
    """
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
    base = str(base)
    if value.startswith("file://"):
        value, base = value[len("file://"):], "/"
    elif "://" in value:
        raise BadInput(Reasons.REMOTE, f"{name}: {value[:80]!r} is a remote URL; the pipeline reads local "
                             "files only (download first)")
    if not storage.is_local(base):
        head = base.split("://", 1)[0]
        return ("path", storage.normalize(f"{head}://{value}" if value.startswith("/") else storage.join(base, value)))
    p = Path(value)
    return ("path", str((p if p.is_absolute() else Path(base) / p).resolve()))
