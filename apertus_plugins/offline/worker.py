"""One batch of the plan: decode, encode, build the documents, write the batch's shards, commit.

:func:`run_batch` is the unit of work that local worker processes and Ray tasks execute. It is
idempotent: a batch whose record exists is not redone. A batch is written as one Megatron indexed
dataset per output stream (``WORK/shards/NNNN/bNNNNNNN{suffix}.bin/.idx``, written with
megatron-core's ``IndexedDatasetBuilder`` under temporary names and renamed), then its record
(``WORK/records/bNNNNNNN.json``: the items written, the items skipped with reasons, token counts)
is written atomically. The record is the batch's checkpoint: a batch without one did not happen,
and a resumed run redoes it from scratch, so a kill at any moment loses at most the batches in
flight.

Fault injection, for tests and drills: ``APERTUS_TOKENIZE_FAULT`` is a comma-separated list of
points; when a point is reached the whole run (the driver's process group, recorded in
``APERTUS_TOKENIZE_PGID``) is killed with SIGKILL, as an out-of-memory kill or a lost node would.

* ``batch-mid:N``: inside batch N, after part of its shard data is on disk, before its commit;
* ``batch-done:N``: right after batch N's record is committed (between batches);
* ``merge-mid:K``: in the merge, after K batch shards were appended to the first output.

With ``--workers 0`` (batches in the driver's own process) the hook kills that process.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .config import TokenizeConfig
from .plan import Plan, batch_items, load_json, save_json
from .sources import BadInput, Item, MediaRef, Reasons, Skip, parse_record, part_source, read_media

__all__ = ["FAULT_ENV", "PGID_ENV", "fault_point", "WorkerContext", "context", "run_batch", "shard_prefix",
           "record_path"]

FAULT_ENV = "APERTUS_TOKENIZE_FAULT"
PGID_ENV = "APERTUS_TOKENIZE_PGID"


def fault_point(point: str, n: int) -> None:
    """Kill the run with SIGKILL if ``point:n`` is listed in ``$APERTUS_TOKENIZE_FAULT``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or f"{point}:{n}" not in {s.strip() for s in spec.split(",")}:
        return
    pgid = os.environ.get(PGID_ENV)
    if pgid:
        os.killpg(int(pgid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def shard_prefix(work: Path, batch: int, suffix: str = "") -> Path:
    return work / "shards" / f"{batch // 1000:04d}" / f"b{batch:07d}{suffix}"


def record_path(work: Path, batch: int) -> Path:
    return work / "records" / f"b{batch:07d}.json"


class WorkerContext:
    """What a worker process needs for every batch: the config, the plan, the tokenizer, the encoders."""

    def __init__(self, work: Path) -> None:
        from ..chat import ChatTokenizer
        from ..plugins import registry
        from .encode import MediaEncoders

        self.work = work
        self.cfg = TokenizeConfig(**load_json(work / "config.json"))
        self.plan = Plan.load(work)
        self.chat = ChatTokenizer(self.cfg.tokenizer)
        self.spec = self.chat.spec
        self.registry = registry()
        self.encoders = MediaEncoders(self.cfg.checkpoint, self.cfg.device, self.cfg.precision, self.cfg.batch_size)
        self.streams = self.cfg.streams()

    # ------------------------------------------------------------------ media
    def _inline(self, ref: MediaRef, record: tuple[list[dict[str, Any]], Path]) -> bytes:
        messages, base = record
        mi, pi = ref.inline or (0, 0)
        _how, data = part_source(messages[mi]["content"]["parts"][pi], base, ref.name)
        return data

    def load(self, ref: MediaRef, record: tuple[list[dict[str, Any]], Path] | None = None) -> np.ndarray:
        """The preprocessed array of one media item (pixels ``[3, H, W]`` or samples at 24 kHz)."""
        from ..media.audio import AudioError, load_audio, preprocess_audio
        from ..media.image import ImageError, preprocess_image

        data = read_media(ref, (lambda r: self._inline(r, record)) if record else None)
        if not data:
            raise BadInput(Reasons.EMPTY, f"{ref.name}: the file is empty (zero bytes)")
        if ref.kind == "image":
            try:
                return preprocess_image(data, self.cfg.resize_policy).pixels
            except (ImageError, OSError) as exc:
                raise BadInput(Reasons.IMAGE, f"{ref.name}: {_strip_name(exc)}") from exc
        if ref.kind == "audio":
            try:
                wave, rate = load_audio(data)
                return preprocess_audio(wave, rate, self.cfg.audio_policy)
            except (AudioError, OSError) as exc:
                raise BadInput(Reasons.AUDIO, f"{ref.name}: {_strip_name(exc)}") from exc
        raise BadInput(Reasons.FORMAT, f"{ref.name}: no loader for modality {ref.kind!r}")

    def sequence(self, kind: str, codes: np.ndarray) -> np.ndarray:
        """The id sequence of one media item, through the registered modality's builder."""
        mod = self.registry.modalities[kind]
        if kind == "image":
            return np.asarray(mod.build_sequence(codes, self.spec, layout=self.cfg.image_layout,
                                                 text_ids=self.chat.char_ids), dtype=np.int64)
        return np.asarray(mod.build_sequence(codes, self.spec), dtype=np.int64)

    # ------------------------------------------------------------------ documents
    def pretrain_document(self, item: Item, codes: np.ndarray) -> np.ndarray:
        from ..media.audio import transcription_sequence

        ref = item.media[0]
        text = item.text or None
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
        from ..chat import ChatFormatError, normalize_messages

        try:
            return normalize_messages(messages)
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{item.name}: {exc}") from exc

    def conversation(self, item: Item) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool | None, Path]:
        path, offset, length = item.record or ("", 0, 0)
        with open(path, "rb") as fh:
            fh.seek(offset)
            raw = fh.read(length)
        messages, tools, thinking = parse_record(raw, item.name)
        base = Path(self.cfg.media_root).resolve() if self.cfg.media_root else Path(path).parent
        return messages, tools, thinking, base

    def sft_documents(self, item: Item, media_ids: list[np.ndarray], record: Any) -> dict[str, np.ndarray]:
        """Ids (and masks) of one conversation for every stream."""
        from ..chat import ChatFormatError, MediaItem, normalize_messages
        from ..targets import sft_mask
        from .sft import has_reasoning, strip_reasoning

        messages, tools, thinking, _base = record
        items = [MediaItem(ref.kind, ids) for ref, ids in zip(item.media, media_ids, strict=True)]
        out: dict[str, np.ndarray] = {}
        try:
            norm = normalize_messages(messages)
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

    # ------------------------------------------------------------------ a batch
    def run(self, batch_id: int) -> dict[str, Any]:
        rec_file = record_path(self.work, batch_id)
        if rec_file.is_file():
            return load_json(rec_file)
        t0 = time.perf_counter()
        items = batch_items(self.work, self.plan.batches[batch_id])
        by_index = {it.index: it for it in items}
        skips: dict[int, Skip] = {}
        records: dict[int, Any] = {}
        arrays: dict[tuple[int, int], np.ndarray] = {}
        for it in items:
            try:
                inline = None
                if it.kind == "conversation":
                    records[it.index] = rec = self.conversation(it)
                    inline = (self._normalized(it, rec[0]), rec[3])
                for k, ref in enumerate(it.media):
                    arrays[(it.index, k)] = self.load(ref, inline)
            except BadInput as exc:
                skips[it.index] = Skip(it.name, exc.reason, exc.detail)
                for k in range(len(it.media)):
                    arrays.pop((it.index, k), None)
        codes: dict[tuple[int, int], np.ndarray] = {}
        for kind in sorted({ref.kind for it in items for ref in it.media}):
            keys = [k for k in arrays if by_index[k[0]].media[k[1]].kind == kind]
            for k, c in zip(keys, self.encoders.encode(kind, [arrays[k] for k in keys]), strict=True):
                codes[k] = c
        docs: list[tuple[int, dict[str, np.ndarray]]] = []
        for it in items:
            if it.index in skips:
                continue
            try:
                if it.kind == "conversation":
                    media_ids = [self.sequence(ref.kind, codes[(it.index, k)]) for k, ref in enumerate(it.media)]
                    docs.append((it.index, self.sft_documents(it, media_ids, records[it.index])))
                else:
                    docs.append((it.index, {"": self.pretrain_document(it, codes[(it.index, 0)])}))
            except BadInput as exc:
                skips[it.index] = Skip(it.name, exc.reason, exc.detail)
        tokens = self._write(batch_id, docs)
        record = {
            "batch": batch_id,
            "documents": len(docs),
            "items": [i for i, _ in docs],
            "skipped": [asdict(skips[i]) for i in sorted(skips)],
            "tokens": tokens,
            "media": {k: sum(1 for i, _ in docs for ref in by_index[i].media if ref.kind == k)
                      for k in sorted({ref.kind for it in items for ref in it.media})},
            "seconds": round(time.perf_counter() - t0, 4),
        }
        save_json(rec_file, record)
        fault_point("batch-done", batch_id)
        return record

    def _write(self, batch_id: int, docs: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, dict[str, int]]:
        """Write the batch's shard of every stream atomically; token counts per stream and modality.

        Shards are intermediate files, written with the core's numpy writer (byte-identical to
        megatron-core's builder, and it keeps torch and megatron-core out of text-only workers);
        the merged outputs are written with megatron-core's ``IndexedDatasetBuilder``.
        """
        from ..indexed import IndexedDatasetWriter

        names = self.spec.modality_names
        tokens: dict[str, dict[str, int]] = {}
        if not docs:
            return {s.suffix: dict.fromkeys(names, 0) for s in self.streams if s.dtype == "int32"}
        for n, stream in enumerate(self.streams):
            final = shard_prefix(self.work, batch_id, stream.suffix)
            writer = IndexedDatasetWriter(final, np.dtype(stream.dtype))
            counts = np.zeros(len(names), dtype=np.int64)
            try:
                for k, (_i, doc) in enumerate(docs):
                    arr = doc[stream.suffix]
                    writer.add_document(arr)
                    if stream.dtype == "int32":
                        counts += np.bincount(self.spec.modality_of(arr), minlength=len(names))[: len(names)]
                    if n == 0 and k == len(docs) // 2 and os.environ.get(FAULT_ENV):
                        writer._fh.flush()
                        fault_point("batch-mid", batch_id)
            except BaseException:
                writer.abort()
                raise
            writer.finalize()  # temporary names, then renamed into place
            if stream.dtype == "int32":
                tokens[stream.suffix] = {name: int(c) for name, c in zip(names, counts, strict=True)}
        for stream in self.streams:
            for ext in (".bin", ".idx"):
                _fsync(f"{shard_prefix(self.work, batch_id, stream.suffix)}{ext}")
        return tokens


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


_CONTEXTS: dict[tuple[str, int], WorkerContext] = {}


def context(work: str | Path) -> WorkerContext:
    """This process's context for a work directory (rebuilt when the run's config.json changes)."""
    work = Path(work)
    key = (str(work.resolve()), (work / "config.json").stat().st_mtime_ns)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        _CONTEXTS.clear()
        ctx = _CONTEXTS[key] = WorkerContext(work)
    return ctx


def run_batch(work: str, batch_id: int) -> dict[str, Any]:
    """Run one batch of the plan in ``work`` (idempotent); returns its record."""
    return context(work).run(batch_id)

