"""The tasks of a run, as plain functions that local processes, Ray tasks and Ray actors execute.

Planning (:func:`plan_shard`, :func:`plan_part`, :func:`count_lines`): one shard of the inputs
scanned from headers, one part of the plan batched (see :mod:`.plan`).

A batch, in three steps that can run in different processes: :func:`decode_batch` (its line of
the plan and its media bytes, decoded and resized on a CPU), :meth:`WorkerContext.encode` (the
media encoders, loaded once per process or actor; a GPU when there is one) and
:func:`write_batch` (the documents, the batch's shards, its record). :func:`run_batch` does the
three in one process. A batch is idempotent: one whose record exists is not redone. It is
written as one Megatron indexed dataset per output stream
(``WORK/shards/pNNNNNN/bNNNNNNN{suffix}.bin/.idx``, with the core's writer under temporary
names, renamed or uploaded whole), then its record (``WORK/records/pNNNNNN/bNNNNNNN.json``:
the items written, the items skipped with reasons, token counts, timings, what it read) is
written atomically. The record is the batch's checkpoint: a batch without one did not happen, and
a resumed run redoes it from scratch, so a kill at any moment loses at most the batches in flight.

Whatever one item raises (a bad file, a failing encoder, a document that cannot be built) costs
only that item: it is skipped with its reason and the stage that found it, and the rest of the
batch is written. When the encoder raises on a batch, the batch is encoded again in halves down to
the arrays it fails on alone (:meth:`WorkerContext._isolated`).

Merging (:func:`merge_part`): the batch shards of one plan part concatenated by megatron-core's
``IndexedDatasetBuilder.add_index``, into the work directory (``merge="single"``, concatenated
again by the driver) or as the part's final dataset (``merge="parts"``).

Fault injection, for tests and drills: ``APERTUS_TOKENIZE_FAULT`` is a comma-separated list of
points; when a point is reached the whole run (the driver's process group, recorded in
``APERTUS_TOKENIZE_PGID``, which Ray workers get too) is killed with SIGKILL, as an out-of-memory
kill or a lost node would.

* ``plan-done:S``: right after planning shard S's summary is written;
* ``batch-mid:N``: inside batch N, after part of its shard data is on disk, before its commit;
* ``batch-done:N``: right after batch N's record is committed (between batches);
* ``merge-part:P``: right after part P's merged dataset and its record are written;
* ``merge-mid:K``: in the final merge (``single``), after K parts were appended to the first output;
* ``crash-item:FILE``: only the process decoding the media file FILE (its base name) is killed, each
  time, as a decoder crashing on that file would.

With ``--workers 0`` (everything in the driver's own process) the hook kills that process.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from . import storage
from .config import TokenizeConfig
from .interleaved import route_by_length
from .plan import BatchRef, ItemWriter, Layout, batch_items, cut_batches, read_items, window_batches, write_part
from .sources import (
    BadInput,
    Item,
    MediaRef,
    Reasons,
    Skip,
    line_starts,
    media_base,
    parse_record,
    parse_recording,
    part_source,
    plugin_modality,
    read_media,
    scan_shard,
    unexpected,
)

__all__ = ["FAULT_ENV", "PGID_ENV", "CRASHES", "fault_point", "WorkerContext", "context", "Decoded", "plan_shard",
           "plan_part", "count_lines", "decode_batch", "write_batch", "run_batch", "run_batch_careful", "merge_part",
           "peak_rss_mb"]

FAULT_ENV = "APERTUS_TOKENIZE_FAULT"
PGID_ENV = "APERTUS_TOKENIZE_PGID"


#: Times an item's worker process may die on it (in careful runs) before the item is skipped: once
#: may be a kill from outside, twice is the item.
CRASHES = 2


def _crash_point(name: str) -> None:
    """``crash-item:FILE`` in ``$APERTUS_TOKENIZE_FAULT``: the process decoding the media file named FILE
    (its base name) dies by SIGKILL, as a crashing decoder would (this process only)."""
    spec = os.environ.get(FAULT_ENV)
    if spec and f"crash-item:{os.path.basename(name.split(' (', 1)[0])}" in {s.strip() for s in spec.split(",")}:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_point(point: str, n: int) -> None:
    """Kill the run with SIGKILL if ``point:n`` is listed in ``$APERTUS_TOKENIZE_FAULT``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or f"{point}:{n}" not in {s.strip() for s in spec.split(",")}:
        return
    pgid = os.environ.get(PGID_ENV)
    if pgid:
        os.killpg(int(pgid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _worker() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "peak_rss_mb": peak_rss_mb()}


def megatron_builder() -> Any:
    """megatron-core's ``IndexedDatasetBuilder`` (imported quietly: it warns about optional fused kernels).

    ``add_index`` runs a full garbage collection per dataset it appends; with torch imported that
    walks a million objects each time. The objects alive now (the imported modules) are frozen out
    of the collector (:func:`gc.freeze`) so a merge of many shards does not pay it per shard.
    """
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    gc.freeze()
    return IndexedDatasetBuilder


@dataclass
class Decoded:
    """A batch after its CPU step: items, preprocessed media by modality, skips, parsed conversations."""

    ref: BatchRef
    items: list[Item]
    arrays: dict[str, tuple[list[tuple[int, int]], list[np.ndarray]]] = field(default_factory=dict)
    skips: dict[int, Skip] = field(default_factory=dict)
    conversations: dict[int, Any] = field(default_factory=dict)
    read: dict[str, Any] = field(default_factory=dict)
    decode_s: float = 0.0

    def without_arrays(self) -> Decoded:
        return Decoded(self.ref, self.items, {k: (keys, []) for k, (keys, _a) in self.arrays.items()}, self.skips,
                       self.conversations, self.read, self.decode_s)


class WorkerContext:
    """What a worker process needs: the config, and (loaded on first use) the tokenizer and the encoders."""

    def __init__(self, work: str) -> None:
        self.layout = Layout(work)
        self.cfg = TokenizeConfig(**storage.read_json(self.layout.config))
        self.media = self.cfg.media_settings()
        self._ready: float | None = None  # when this process's first encoder was loaded
        self._busy = 0.0  # seconds spent in the encoders since

    @cached_property
    def chat(self) -> Any:
        from apertus_plugins.core.chat import ChatTokenizer
        from apertus_plugins.plugins import spec_from_tokenizer_dir

        # the tokenizer's layout with the installed modalities (a plugin's parts and markers)
        return ChatTokenizer(self.cfg.tokenizer, spec_from_tokenizer_dir(self.cfg.tokenizer))

    @property
    def spec(self) -> Any:
        return self.chat.spec

    @cached_property
    def registry(self) -> Any:
        from apertus_plugins.plugins import registry

        return registry()

    @cached_property
    def encoders(self) -> Any:
        from apertus_plugins.encoders.cache import MediaCodeCache

        from .encode import MediaEncoders

        cache = MediaCodeCache.resolve(self.cfg.media_cache or "0", self.cfg.media_cache_size)
        return MediaEncoders(self.cfg.checkpoint, self.cfg.device, self.cfg.precision, self.cfg.batch_size, cache)

    @cached_property
    def streams(self) -> list[Any]:
        return self.cfg.streams()

    # ------------------------------------------------------------------ planning
    def plan_shard(self, shard: int, spec: dict[str, Any]) -> dict[str, Any]:
        """Scan one shard: its item file, then its summary (the shard's checkpoint)."""
        where = self.layout.scan_summary(shard)
        if storage.isfile(where):
            return storage.read_json(where)
        t0 = time.perf_counter()
        writer = ItemWriter(self.layout.scan_items(shard))
        try:
            found = scan_shard(spec, self.media, self.cfg.media_root, writer)
        except BaseException:
            writer.discard()
            raise
        writer.commit()
        summary = {"shard": shard, "items": found.items, "media": found.media,
                   "skipped": [asdict(s) for s in found.skips], "referenced": found.referenced,
                   "read": found.read, "seconds": round(time.perf_counter() - t0, 4), "worker": _worker()}
        storage.write_json(where, summary)
        fault_point("plan-done", shard)
        return summary

    def plan_part(self, part: int, shards: list[list[int]], window: list[int] | None) -> dict[str, Any]:
        """Batch one part of the plan: the windows starting in shard ``part`` (pretrain) or its items (sft).

        ``shards``: ``[shard, first item, items]`` of the shards holding the part's items;
        ``window``: the part's items ``[lo, hi)`` (pretrain; ``None`` when no window starts in it).
        """
        where = self.layout.part_summary(part)
        if storage.isfile(where):
            return storage.read_json(where)
        t0 = time.perf_counter()
        cfg = self.cfg
        if cfg.kind in ("sft", "interleaved"):
            (_s, start, count), = shards
            items = list(read_items(self.layout, shards, start, start + count))
            runs = cut_batches(((k, it.codes) for k, it in enumerate(items)), cfg.batch_size, cfg.batch_codes)
            batches = (([items[k] for k in run], None, sum(items[k].codes for k in run)) for run in runs)
        else:
            batches = self._window_batches(shards, window)
        lines, n_items = write_part(self.layout, part, batches)
        summary = {"part": part, "batches": len(lines), "items": n_items, "lines": lines,
                   "read": [self.layout.scan_items(s) for s, _a, n in shards if n],
                   "seconds": round(time.perf_counter() - t0, 4), "worker": _worker()}
        storage.write_json(where, summary)
        return summary

    def _window_batches(self, shards: list[list[int]], window: list[int] | None) -> Any:
        if window is None:
            return
        lo, hi = window
        size = self.cfg.window
        audio = self.cfg.audio_batching_settings()
        buf: list[Item] = []
        for it in read_items(self.layout, shards, lo, hi):
            buf.append(it)
            if len(buf) == size:
                for positions, shape, codes in window_batches(buf, self.cfg.batch_size, self.cfg.batch_codes, audio):
                    yield [buf[p] for p in positions], shape, codes
                buf = []
        if buf:
            for positions, shape, codes in window_batches(buf, self.cfg.batch_size, self.cfg.batch_codes, audio):
                yield [buf[p] for p in positions], shape, codes

    # ------------------------------------------------------------------ media
    def _inline(self, ref: MediaRef, record: tuple[list[dict[str, Any]], str]) -> bytes:
        messages, base = record
        mi, pi = ref.inline or (0, 0)
        _how, data = part_source(messages[mi]["content"]["parts"][pi], base, ref.name)
        return data

    def load(self, ref: MediaRef, record: tuple[list[dict[str, Any]], str] | None = None) -> np.ndarray:
        """The preprocessed array of one media item (pixels ``[3, H, W]`` or samples at 24 kHz), through
        the run's :class:`~.preprocess.MediaSettings`."""
        from apertus_plugins.core.media.audio import AudioError
        from apertus_plugins.core.media.image import ImageError

        data = read_media(ref, (lambda r: self._inline(r, record)) if record else None)
        if not data:
            raise BadInput(Reasons.EMPTY, f"{ref.name}: the file is empty (zero bytes)")
        if ref.kind == "image":
            try:
                return self.media.image(data)
            except (ImageError, OSError) as exc:
                raise BadInput(Reasons.IMAGE, f"{ref.name}: {_strip_name(exc)}") from exc
        if ref.kind == "audio":
            try:
                return self.media.audio(data)
            except (AudioError, OSError) as exc:
                raise BadInput(Reasons.AUDIO, f"{ref.name}: {_strip_name(exc)}") from exc
        mod = plugin_modality(ref.kind, "load")
        try:
            return np.asarray(mod.load(data))
        except (ValueError, OSError) as exc:
            raise BadInput(Reasons.MEDIA, f"{ref.name}: {_strip_name(exc)}") from exc

    def sequence(self, kind: str, codes: np.ndarray) -> np.ndarray:
        """The id sequence of one media item, through the registered modality's builder."""
        mod = self.registry.modalities[kind]
        kw = {"layout": self.cfg.image_layout} if mod.codes_in == "image" else {}  # image-coded: the run's layout
        return np.asarray(mod.build_sequence(codes, self.spec, text_ids=self.chat.char_ids, **kw), dtype=np.int64)

    # ------------------------------------------------------------------ documents
    def pretrain_document(self, item: Item, codes: np.ndarray) -> np.ndarray:
        from apertus_plugins.core.media.audio import transcription_sequence

        ref = item.media[0]
        text = item.text or None
        if ref.kind == "audio" and codes.size == 0:
            raise BadInput(Reasons.PADDED, f"{ref.name}: padded in its batch, it loses its last five codes and none "
                           "are left (--audio-batching report)")
        if ref.kind == "audio":
            task = self.cfg.audio_task
            if task == "auto":
                task = "transcribe" if text else "audio"
            if task == "audio":
                body = self.sequence("audio", codes)
            elif not text:
                raise BadInput(Reasons.NO_TRANSCRIPT, f"{item.name}: --audio-task {task} needs a transcript "
                                     "(a .txt beside the clip or a txt component), none found")
            else:
                body = transcription_sequence(codes, self.chat.text_ids(text), self.spec, task)
        else:
            seq = self.sequence(ref.kind, codes)
            caption = np.asarray(self.chat.text_ids(text) if text and self.cfg.captions != "ignore" else [], np.int64)
            body = np.concatenate([caption, seq] if self.cfg.captions == "before" else [seq, caption])
        head = [self.spec.bos_id] if self.cfg.bos else []
        tail = [self.spec.eos_id] if self.cfg.eos else []
        return np.concatenate([np.asarray(head, np.int64), body, np.asarray(tail, np.int64)])

    def _normalized(self, item: Item, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from apertus_plugins.core.chat import ChatFormatError, normalize_messages

        try:
            return normalize_messages(messages, self.spec)
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{item.name}: {exc}") from exc

    def conversation(self, item: Item) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool | None, str]:
        path, offset, length = item.record or ("", 0, 0)
        raw = storage.read_bytes(path, offset, length)
        messages, tools, thinking = parse_record(raw, item.name)
        return messages, tools, thinking, media_base(path, self.cfg.media_root)

    def recording(self, item: Item) -> list[str]:
        """The transcripts of a recording's clips (interleaved runs), read again from its JSONL line."""
        path, offset, length = item.record or ("", 0, 0)
        clips = parse_recording(storage.read_bytes(path, offset, length), item.name)
        if len(clips) != len(item.media):
            raise BadInput(Reasons.RECORDING, f"{item.name}: {len(clips)} clips, the plan has {len(item.media)} "
                           "(the file changed since it was planned)")
        return [c.text for c in clips]

    def recording_documents(self, item: Item, codes: list[np.ndarray], transcripts: list[str]) -> list[np.ndarray]:
        """The interleaved documents of one recording (:mod:`.interleaved`)."""
        from .interleaved import recording_documents

        for ref, c in zip(item.media, codes, strict=True):
            if c.size == 0:
                raise BadInput(Reasons.PADDED, f"{ref.name}: padded in its batch, it loses its last five codes and "
                               "none are left (--audio-batching report)")
        texts = [self.chat.text_ids(t) for t in transcripts]
        return recording_documents(codes, texts, self.spec, bos=self.cfg.bos, eos=self.cfg.eos)

    def sft_documents(self, item: Item, media_ids: list[np.ndarray], record: Any) -> dict[str, np.ndarray]:
        """Ids (and masks) of one conversation for every stream."""
        from apertus_plugins.core.chat import ChatFormatError, MediaItem, normalize_messages
        from apertus_plugins.core.chat.template import reasoning_as_blocks
        from apertus_plugins.core.targets import sft_mask

        from .sft import has_reasoning, strip_reasoning

        messages, tools, thinking, _base = record
        items = [MediaItem(ref.kind, ids) for ref, ids in zip(item.media, media_ids, strict=True)]
        out: dict[str, np.ndarray] = {}
        try:
            messages = reasoning_as_blocks(messages)  # the template renders thinking from blocks only
            norm = normalize_messages(messages, self.spec)
            enable = has_reasoning(norm) if thinking is None else thinking
            enc = self.chat.encode_conversation(messages, tools=tools, enable_thinking=enable, variant="training",
                                                media=items)
            out[""] = enc.ids
            if self.cfg.without_reasoning:
                stripped, kept = strip_reasoning(norm)
                enc2 = self.chat.encode_conversation(stripped, tools=tools, enable_thinking=False,
                                                     variant="training",
                                                     media=[m for m, k in zip(items, kept, strict=True) if k])
                out[".noreason"] = enc2.ids
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{item.name}: {exc}") from exc
        if self.cfg.mask_stream:
            for key in [k for k in out if not k.endswith(".mask")]:
                ids = out[key]
                mask = np.zeros(ids.size, dtype=np.uint8)
                mask[1:] = sft_mask(ids, self.spec)
                out[f"{key}.mask"] = mask
        return out

    # ------------------------------------------------------------------ a batch, step by step
    def done(self, ref: BatchRef) -> dict[str, Any] | None:
        where = self.layout.record(ref.part, ref.id)
        return storage.read_json(where) if storage.isfile(where) else None

    def decode(self, ref: BatchRef) -> Decoded:
        """Read the batch's line of the plan and its media; decode and preprocess them (CPU)."""
        t0 = time.perf_counter()
        items, _shape = batch_items(self.layout, ref)
        out = Decoded(ref, items)
        out.read = {"plan": [self.layout.part_batches(ref.part), ref.offset, ref.length], "media": []}
        self._decode_items(items, out)
        out.decode_s = time.perf_counter() - t0
        return out

    def _decode_items(self, items: list[Item], out: Decoded) -> None:
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
                    _crash_point(ref_.name)
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

    def encode(self, arrays: dict[str, tuple[list[Any], list[np.ndarray]]]) -> dict[str, Any]:
        """Codes of every modality's preprocessed arrays, and the encoder's clock.

        ``codes``: per modality, the codes of each array in order (``None`` where the encoder failed);
        ``failed``: per modality, the failed arrays' positions and the errors (see :meth:`_isolated`);
        ``encode_s``: seconds in the encoders for these arrays (loading an encoder is not counted);
        ``encoder``: this process, with ``busy_s`` (encoder seconds so far) and ``uptime_s`` (seconds
        since its first encoder was loaded): their ratio is the encoder's utilisation;
        ``media_cache``: with the media-code cache on, the items of these arrays found in it
        (``hits``) and encoded (``misses``).
        """
        kinds = sorted(k for k, (_keys, arr) in arrays.items() if arr)
        t_load = time.perf_counter()
        for kind in kinds:
            self.encoders.load(kind)
        load_s = time.perf_counter() - t_load
        if kinds and self._ready is None:
            self._ready = time.perf_counter()
        cache = self.encoders.cache
        before = (cache.hits, cache.misses) if cache is not None else (0, 0)
        t0 = time.perf_counter()
        codes: dict[str, list[np.ndarray | None]] = {}
        failed: dict[str, dict[int, str]] = {}
        for kind in kinds:
            if kind == "audio" and self.cfg.audio_batching == "report":
                codes[kind], bad = self._padded(arrays[kind][1])
            else:
                codes[kind], bad = self._isolated(kind, arrays[kind][1])
            if bad:
                failed[kind] = bad
        encode_s = time.perf_counter() - t0
        self._busy += encode_s
        clock = {"busy_s": round(self._busy, 4),
                 "uptime_s": round(time.perf_counter() - self._ready, 4) if self._ready is not None else 0.0}
        out = {"codes": codes, "failed": failed, "encode_s": encode_s, "load_s": load_s,
               "device": self.encoders.device, "loads": self.encoders.loads, "encoder": {**_worker(), **clock}}
        if cache is not None:
            out["media_cache"] = {"hits": cache.hits - before[0], "misses": cache.misses - before[1]}
        return out

    def _padded(self, arrays: list[np.ndarray]) -> tuple[list[np.ndarray | None], dict[int, str]]:
        """Audio codes under the report's batching (:mod:`.batching`): the clips of a pretraining batch are
        one padded batch (the plan made it); the clips of a batch of recordings are first cut into
        duration batches. A padded batch the encoder raises on is encoded in halves (their padding,
        and so the codes near a clip's end, then differ), down to single clips (:meth:`_isolated`).
        """
        from .batching import duration_batches

        if self.cfg.kind == "pretrain":
            groups = [list(range(len(arrays)))]
        else:
            settings = self.cfg.audio_batching_settings()
            groups = duration_batches([a.size for a in arrays], settings, self.cfg.batch_size)
        out: list[np.ndarray | None] = [None] * len(arrays)
        failed: dict[int, str] = {}
        for group in groups:
            got, bad = self._isolated("audio", [arrays[i] for i in group], padded=True)
            for j, i in enumerate(group):
                out[i] = got[j]
                if j in bad:
                    failed[i] = bad[j]
        return out, failed

    def _isolated(self, kind: str, arrays: list[np.ndarray],
                  padded: bool = False) -> tuple[list[np.ndarray | None], dict[int, str]]:
        """Codes of ``arrays``; when the encoder raises on a group, its halves are encoded apart, down to
        single arrays: an array the encoder fails on alone is left out (``None``, and its error by
        position), every other one is encoded. The encoders never pad, so an array's codes do not
        depend on what it was batched with: the result equals the batched one wherever both exist.
        """
        out: list[np.ndarray | None] = [None] * len(arrays)
        failed: dict[int, str] = {}
        todo = [list(range(len(arrays)))]
        while todo:
            group = todo.pop()
            try:
                got = self.encoders.encode(kind, [arrays[i] for i in group], padded=padded)
            except Exception as exc:  # noqa: BLE001 (found by bisection; one array's failure costs only it)
                if len(group) == 1:
                    failed[group[0]] = f"{type(exc).__name__}: {exc}"
                else:
                    half = len(group) // 2
                    todo += [group[half:], group[:half]]  # the first half next: errors in input order
                continue
            for i, c in zip(group, got, strict=True):
                out[i] = c
        return out, failed

    def write(self, dec: Decoded, enc: dict[str, Any]) -> dict[str, Any]:
        """Build the documents, write the batch's shards, commit its record."""
        t0 = time.perf_counter()
        ref, items, skips = dec.ref, dec.items, dict(dec.skips)
        by_index = {it.index: it for it in items}
        codes: dict[tuple[int, int], np.ndarray] = {}
        for kind, (keys, _arr) in dec.arrays.items():
            failed = enc.get("failed", {}).get(kind, {})
            for pos, (key, c) in enumerate(zip(keys, enc["codes"].get(kind, []), strict=True)):
                i, k = key
                if pos in failed:
                    it = by_index[i]
                    skips.setdefault(i, Skip(it.name, Reasons.ENCODER, f"{it.media[k].name}: the {kind} encoder failed "
                                             f"on it alone ({failed[pos]}); the rest of its batch is written", "encode"))
                else:
                    codes[(i, k)] = c
        docs: list[tuple[int, dict[str, np.ndarray]]] = []
        for it in items:
            if it.index in skips:
                continue
            try:
                if it.kind == "conversation":
                    media_ids = [self.sequence(m.kind, codes[(it.index, k)]) for k, m in enumerate(it.media)]
                    docs.append((it.index, self.sft_documents(it, media_ids, dec.conversations[it.index])))
                elif it.kind == "recording":
                    clip_codes = [codes[(it.index, k)] for k in range(len(it.media))]
                    seqs = self.recording_documents(it, clip_codes, dec.conversations[it.index])
                    docs.extend((it.index, {suffix: d}) for suffix, d in route_by_length(seqs, self.cfg.split_tokens))
                else:
                    docs.append((it.index, {"": self.pretrain_document(it, codes[(it.index, 0)])}))
            except BadInput as exc:
                skips[it.index] = Skip(it.name, exc.reason, exc.detail, "document")
            except Exception as exc:  # noqa: BLE001 (one item's failure costs only that item)
                skips[it.index] = unexpected(it.name, "document", exc)
        tokens = self._write(ref, docs)
        kinds = sorted({m.kind for it in items for m in it.media})
        written = sorted({i for i, _ in docs})
        write_s = time.perf_counter() - t0
        record = {
            "batch": ref.id,
            "part": ref.part,
            "documents": len(docs),
            "stream_documents": {s.suffix: sum(1 for _i, d in docs if s.suffix in d) for s in self.streams},
            "items": written,
            "skipped": [asdict(skips[i]) for i in sorted(skips)],
            "tokens": tokens,
            "media": {k: sum(1 for i in written for m in by_index[i].media if m.kind == k) for k in kinds},
            "seconds": round(dec.decode_s + enc.get("encode_s", 0.0) + write_s, 4),
            "decode_s": round(dec.decode_s, 4),
            "encode_s": round(enc.get("encode_s", 0.0), 4),
            "write_s": round(write_s, 4),
            "device": enc.get("device"),
            "read": dec.read,
            "worker": _worker(),
            "encoder": enc.get("encoder"),
        }
        if enc.get("media_cache"):
            record["media_cache"] = enc["media_cache"]
        storage.write_json(self.layout.record(ref.part, ref.id), record)
        fault_point("batch-done", ref.id)
        return record

    def run(self, ref: BatchRef) -> dict[str, Any]:
        """Decode, encode and write one batch in this process (idempotent)."""
        done = self.done(ref)
        if done is not None:
            return done
        dec = self.decode(ref)
        enc = self.encode(dec.arrays) if dec.arrays else {}
        return self.write(dec, enc)

    def run_careful(self, ref: BatchRef) -> dict[str, Any]:
        """Run a batch whose worker process died: item by item, each item's index recorded before it is
        decoded and encoded (``WORK/crashes/...``), so an item its worker dies on :data:`CRASHES` times
        (a decoder's crash, the kernel's out-of-memory kill) is found and skipped and the rest of the
        batch is written, with the bytes a plain run gives (the encoders never pad)."""
        done = self.done(ref)
        if done is not None:
            return done
        where = self.layout.crashes(ref.part, ref.id)
        state = storage.read_json(where) if storage.isfile(where) else {"current": None, "crashes": {}}
        if state["current"] is not None:  # the previous careful attempt's worker died on this item
            key = str(state["current"])
            state["crashes"][key] = state["crashes"].get(key, 0) + 1
            state["current"] = None
        t0 = time.perf_counter()
        items, _shape = batch_items(self.layout, ref)
        dec = Decoded(ref, items)
        dec.read = {"plan": [self.layout.part_batches(ref.part), ref.offset, ref.length], "media": []}
        enc: dict[str, Any] = {"codes": {}, "failed": {}, "encode_s": 0.0}
        for it in items:
            died = state["crashes"].get(str(it.index), 0)
            if died >= CRASHES:
                dec.skips[it.index] = Skip(it.name, Reasons.CRASH, f"{it.name}: its worker process died {died} times "
                                           "while it was decoded or encoded (a crash in a decoder or the encoder, or "
                                           "out of memory); the rest of its batch is written", "decode")
                continue
            state["current"] = it.index
            storage.write_json(where, state)
            one = Decoded(ref, [it], read=dec.read)
            self._decode_items([it], one)
            dec.skips.update(one.skips)
            dec.conversations.update(one.conversations)
            got = self.encode(one.arrays) if one.arrays else {}
            for kind, (keys, _arrays) in one.arrays.items():
                dec.arrays.setdefault(kind, ([], []))[0].extend(keys)
                codes = enc["codes"].setdefault(kind, [])
                for pos, msg in got.get("failed", {}).get(kind, {}).items():
                    enc["failed"].setdefault(kind, {})[len(codes) + pos] = msg
                codes.extend(got["codes"].get(kind, []))
            if got:
                enc.update({k: v for k, v in got.items() if k not in ("codes", "failed", "encode_s")})
                enc["encode_s"] += got["encode_s"]
        state["current"] = None
        storage.write_json(where, state)
        dec.decode_s = time.perf_counter() - t0 - enc["encode_s"]
        return self.write(dec, enc)

    def _write(self, ref: BatchRef, docs: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, dict[str, int]]:
        """Write the batch's shard of every stream atomically; token counts per stream and modality.

        Shards are intermediate files, written with the core's numpy writer (byte-identical to
        megatron-core's builder, and it keeps torch and megatron-core out of text-only workers);
        the merged outputs are written with megatron-core's ``IndexedDatasetBuilder``.
        """
        import tempfile

        from ..indexed import IndexedDatasetWriter

        names = self.spec.modality_names
        tokens: dict[str, dict[str, int]] = {}
        if not docs:
            return {s.suffix: dict.fromkeys(names, 0) for s in self.streams if s.dtype == "int32"}
        local = storage.is_local(self.layout.work)
        tmp_dir = None if local else tempfile.mkdtemp(prefix="apertus-shard-")
        try:
            for n, stream in enumerate(self.streams):
                final = self.layout.shard_prefix(ref.part, ref.id, stream.suffix)
                target = storage.local_path(final) if local else os.path.join(tmp_dir, f"b{ref.id:07d}{stream.suffix}")
                writer = IndexedDatasetWriter(target, np.dtype(stream.dtype))
                counts = np.zeros(len(names), dtype=np.int64)
                try:
                    for k, (_i, doc) in enumerate(docs):
                        arr = doc.get(stream.suffix)
                        if arr is None:  # an interleaved sequence goes to one of the streams only
                            continue
                        writer.add_document(arr)
                        if stream.dtype == "int32":
                            counts += np.bincount(self.spec.modality_of(arr), minlength=len(names))[: len(names)]
                        if n == 0 and k == len(docs) // 2 and os.environ.get(FAULT_ENV):
                            writer._fh.flush()
                            fault_point("batch-mid", ref.id)
                except BaseException:
                    writer.abort()
                    raise
                writer.finalize()  # temporary names, then renamed into place
                for ext in (".bin", ".idx"):
                    _fsync(f"{target}{ext}")
                    if not local:
                        storage.upload(f"{target}{ext}", f"{final}{ext}")
                if stream.dtype == "int32":
                    tokens[stream.suffix] = {name: int(c) for name, c in zip(names, counts, strict=True)}
        finally:
            if tmp_dir:
                import shutil

                shutil.rmtree(tmp_dir, ignore_errors=True)
        return tokens

    # ------------------------------------------------------------------ merge
    def merge_part(self, part: int, first: int, count: int) -> dict[str, Any]:
        """Concatenate the part's batch shards (megatron-core's ``add_index``); its summary is its checkpoint."""
        where = self.layout.merged_record(part)
        if storage.isfile(where):
            return storage.read_json(where)
        import tempfile

        from apertus_plugins.core.media.image import dataset_image_layouts

        from ..indexed import IndexedDataset
        from ..manifest import describe_dataset

        t0 = time.perf_counter()
        cfg = self.cfg
        records = []
        for b in range(first, first + count):
            rec = self.layout.record(part, b)
            if not storage.isfile(rec):
                raise ValueError(f"{rec}: batch {b} has no record; it did not finish")
            records.append(storage.read_json(rec))
        written = [r for r in records if r["documents"]]
        docs = sum(r["documents"] for r in written)
        final = cfg.merge == "parts"
        entries: list[dict[str, Any]] = []
        layouts: set[str] = set()
        builder_cls = megatron_builder() if written else None
        tmp_dir = tempfile.mkdtemp(prefix="apertus-merge-")
        try:
            for stream in self.streams if written else []:
                dest = cfg.part_prefix(part, stream) if final else self.layout.merged_prefix(part, stream.suffix)
                local = storage.is_local(dest)
                target = f"{storage.local_path(dest)}.tmp" if local else os.path.join(tmp_dir, "part")
                if local:
                    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                shards = [self.layout.shard_prefix(part, r["batch"], stream.suffix) for r in written]
                with storage.local_copy([f"{s}{e}" for s in shards for e in (".bin", ".idx")]) as paths:
                    builder = builder_cls(f"{target}.bin", dtype=np.dtype(stream.dtype).type)
                    for k, r in enumerate(written):
                        prefix = paths[2 * k][: -len(".bin")]
                        n = IndexedDataset(prefix).num_documents
                        want = r.get("stream_documents", {}).get(stream.suffix, r["documents"])
                        if n != want:
                            raise ValueError(f"{shards[k]}: {n} documents, its record says {want}")
                        builder.add_index(prefix)
                    builder.finalize(f"{target}.idx")
                for ext in (".bin", ".idx"):
                    _fsync(f"{target}{ext}")
                if stream.suffix == "":
                    layouts = dataset_image_layouts(IndexedDataset(target), self.spec, limit=64)
                if final:
                    entry = describe_dataset(target)
                    entry["prefix"] = dest
                    entries.append(entry)
                for ext in (".bin", ".idx"):
                    storage.upload(f"{target}{ext}", f"{dest}{ext}")
        finally:
            import shutil

            shutil.rmtree(tmp_dir, ignore_errors=True)
        summary = _aggregate(records, self.streams, self.spec.modality_names)
        summary.update(part=part, documents=docs, stream_documents={
            s.suffix: sum(r.get("stream_documents", {}).get(s.suffix, r["documents"]) for r in written)
            for s in self.streams}, written_items=sum(len(r["items"]) for r in written), entries=entries, layouts=sorted(layouts),
                       merge_s=round(time.perf_counter() - t0, 4), worker=_worker())
        storage.write_json(where, summary)
        fault_point("merge-part", part)
        return summary


def _aggregate(records: list[dict[str, Any]], streams: list[Any], names: list[str]) -> dict[str, Any]:
    """The sums of a part's batch records: what the report and the progress view need."""
    tokens = {s.suffix: dict.fromkeys(names, 0) for s in streams if s.dtype == "int32"}
    media: dict[str, int] = {}
    skipped: list[dict[str, Any]] = []
    devices: set[str] = set()
    out = {"batches": len(records), "items": 0, "decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0}
    for r in records:
        out["items"] += len(r["items"]) + len(r["skipped"])
        skipped.extend(r["skipped"])
        for suffix, counts in r["tokens"].items():
            for n, v in counts.items():
                tokens[suffix][n] = tokens[suffix].get(n, 0) + v
        for k, v in r.get("media", {}).items():
            media[k] = media.get(k, 0) + v
        for key in ("decode_s", "encode_s", "write_s"):
            out[key] += r.get(key, 0.0)
        if r.get("device"):
            devices.add(r["device"])
    out.update(tokens=tokens, media=media, skipped=skipped, devices=sorted(devices))
    return out


def _strip_name(exc: BaseException) -> str:
    """The core's message without its leading ``<N bytes>: `` (the caller names the item)."""
    msg = str(exc)
    if msg.startswith("<") and ">: " in msg:
        return msg.split(">: ", 1)[1]
    return msg


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CONTEXTS: dict[tuple[str, Any], WorkerContext] = {}


def context(work: str) -> WorkerContext:
    """This process's context for a work directory (rebuilt when the run's config.json changes)."""
    key = (storage.canonical(work), storage.stamp(Layout(work).config)[1])
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        _CONTEXTS.clear()
        ctx = _CONTEXTS[key] = WorkerContext(work)
    return ctx


# ---------------------------------------------------------------------- task entry points
def plan_shard(work: str, shard: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Scan one planning shard (idempotent); returns its summary."""
    return context(work).plan_shard(shard, spec)


def count_lines(path: str, start: int, end: int) -> int:
    """Lines of a JSONL file starting in ``[start, end)`` (the names of the next range's conversations)."""
    return line_starts(path, start, end)


def plan_part(work: str, part: int, shards: list[list[int]], window: list[int] | None) -> dict[str, Any]:
    """Batch one part of the plan (idempotent); returns its summary."""
    return context(work).plan_part(part, shards, window)


def run_batch(work: str, ref: BatchRef) -> dict[str, Any]:
    """Run one batch of the plan in ``work`` (idempotent); returns its record."""
    return context(work).run(ref)


def run_batch_careful(work: str, ref: BatchRef) -> dict[str, Any]:
    """Run one batch whose worker process died, item by item (:meth:`WorkerContext.run_careful`)."""
    return context(work).run_careful(ref)


def decode_batch(work: str, ref: BatchRef) -> tuple[dict[str, Any], Decoded | dict[str, Any]]:
    """The CPU step of a batch: ``(arrays by modality, the rest)``; a finished batch gives ``({}, its record)``."""
    ctx = context(work)
    done = ctx.done(ref)
    if done is not None:
        return {}, done
    dec = ctx.decode(ref)
    return dec.arrays, dec.without_arrays()


def write_batch(work: str, dec: Decoded, enc: dict[str, Any] | None) -> dict[str, Any]:
    """The last step of a batch: documents, shards, record."""
    return context(work).write(dec, enc or {})


def merge_part(work: str, part: int, first: int, count: int) -> dict[str, Any]:
    """Merge one part's batch shards (idempotent); returns the part's summary."""
    return context(work).merge_part(part, first, count)
