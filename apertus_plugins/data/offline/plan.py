"""The deterministic plan: which items go into which batch, in which order, as files that tasks write.

The plan is computed from headers only (:mod:`.sources`) and depends on nothing but the inputs
and the output-deciding settings, never on the worker count or on scheduling. It is made by
parallel tasks and kept as a list of per-shard files in the work directory (:class:`Layout`):

1. listing (the driver): the inputs cut into planning shards, ``plan/shards.jsonl`` (one spec per
   line, with every file's size and stamp), then ``plan/listing.json``;
2. scanning (a task per shard): the shard's items with their header shapes,
   ``plan/scan/sNNNNNN.jsonl``, then its summary ``sNNNNNN.json`` (skips, referenced files);
3. batching (a task per shard): the shard's batches with their items, ``plan/batches/pNNNNNN.jsonl``
   (part ``p`` of the plan; one line per batch, what a worker executes and all it reads), then
   its summary ``pNNNNNN.json`` (the byte range of every line);
4. ``plan.json`` (the driver, last): the fingerprint and the parts table (first batch, batches,
   items per part). A plan exists when ``plan.json`` does; a resumed run reuses every step that
   finished, after checking that the settings and the listed inputs are unchanged.

No process holds more than one shard's items (a batching task: one window's).

Pretraining: the items are cut into windows of ``window`` consecutive source items (counted over
the whole input, across shards); inside a window they are grouped by modality and exact
post-preprocessing shape (groups in sorted shape order, items in source order), and each group
is cut into batches of at most ``batch_size`` items and ``batch_codes`` codes. Every batch is
shape-uniform, so the encoders batch it without padding. The output is written in plan order
(batch by batch). A window belongs to the part of the shard it starts in, so the batches, and
the bytes written, do not depend on how the inputs were cut into shards.

SFT: consecutive conversations of a shard form a batch (at most ``batch_size`` of them and
``batch_codes`` media codes); inside a batch the media of all conversations are encoded in
shape-uniform groups. The output is in source order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apertus_plugins.data.offline import storage

from .batching import AudioBatching, cut_batches, duration_batches
from .sources import Item

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Batch", "BatchRef", "PartRow", "Plan", "Layout", "make_batches",
           "window_batches", "cut_batches", "part_windows", "read_items", "batch_items"]

PLAN_FORMAT = "apertus-tokenize-plan"
PLAN_VERSION = 2


@dataclass
class Batch:
    """A unit of work: item indices in output order, the shared shape (pretraining) and its codes."""

    id: int
    items: list[int]
    shape: list[Any] | None
    codes: int


@dataclass(frozen=True)
class BatchRef:
    """A batch by where its line is: its id, its plan part and number in the part, the line's byte range."""

    id: int
    part: int
    index: int
    offset: int
    length: int
    items: int


class PartRow(NamedTuple):
    """A part of the plan in ``plan.json``: its first batch id, its batches and its items."""

    first: int
    batches: int
    items: int


@dataclass
class Plan:
    """``plan.json``: the settings' fingerprint, what the inputs hold and the parts table (see the module doc)."""

    fingerprint: dict[str, Any]
    kind: str
    shards: int
    files: int
    listing_sha256: str
    total_items: int
    plan_skipped: int
    plan_skipped_by_reason: dict[str, int] | None
    plan_skipped_latest: list[Any]
    media: dict[str, int]
    batches: int
    parts: list[PartRow]
    referenced: list[list[Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The document written as ``plan.json`` (its keys in the order they have always had)."""
        out: dict[str, Any] = {"format": PLAN_FORMAT, "version": PLAN_VERSION}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "parts":
                value = [list(row) for row in value]
            if value is not None or name != "plan_skipped_by_reason":
                out[name] = value
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any], where: str) -> Plan:
        """A ``plan.json`` read back; one of another format or version raises ``ValueError``."""
        if doc.get("format") != PLAN_FORMAT or doc.get("version") != PLAN_VERSION:
            raise ValueError(f"{where}: not a version-{PLAN_VERSION} {PLAN_FORMAT} file")
        fields = {k: doc.get(k) for k in cls.__dataclass_fields__}
        fields["parts"] = [PartRow(*row) for row in doc["parts"]]
        fields["plan_skipped_latest"] = fields["plan_skipped_latest"] or []
        fields["referenced"] = fields["referenced"] or []
        return cls(**fields)


def window_batches(items: list[Item], batch_size: int, batch_codes: int,
                   audio: AudioBatching | None = None) -> list[tuple[list[int], list[Any], int]]:
    """The batches of one pretraining window: ``(positions in items, [kind, shape], codes)``, in plan order.

    ``audio``: the ``report`` audio batching (:mod:`.batching`): the window's clips are cut by
    :func:`~.batching.duration_batches` into mixed-length batches (shape ``[]``) that the encoder
    pads, after the shape-uniform batches; ``None`` (the default ``exact`` batching): clips are
    grouped by exact length like images by exact size.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    padded: list[int] = []
    for pos, it in enumerate(items):
        ref = it.media[0]
        if audio is not None and ref.kind == "audio":
            padded.append(pos)
        else:
            groups.setdefault((ref.kind, tuple(ref.shape)), []).append(pos)
    out = []
    for (kind, shape), positions in sorted(groups.items()):
        for run in cut_batches(((p, items[p].codes) for p in positions), batch_size, batch_codes):
            out.append((run, [kind, list(shape)], sum(items[p].codes for p in run)))
    if audio is not None and padded:
        for run in duration_batches([items[p].media[0].shape[0] for p in padded], audio, batch_size):
            positions = [padded[k] for k in run]
            out.append((positions, ["audio", []], sum(items[p].codes for p in positions)))
    return out


def make_batches(items: list[Item], kind: str, batch_size: int, batch_codes: int, window: int,
                 audio: AudioBatching | None = None) -> list[Batch]:
    """The batches of a whole plan held in memory (one shard; the pipeline batches part by part)."""
    if kind in ("sft", "interleaved"):
        return [Batch(k, run, None, sum(items[i].codes for i in run))
                for k, run in enumerate(cut_batches(((i.index, i.codes) for i in items), batch_size, batch_codes))]
    out: list[Batch] = []
    for w in range(0, len(items), window):
        chunk = items[w : w + window]
        for positions, shape, codes in window_batches(chunk, batch_size, batch_codes, audio):
            out.append(Batch(len(out), [chunk[p].index for p in positions], shape, codes))
    return out


def part_windows(start: int, count: int, total: int, window: int) -> tuple[int, int] | None:
    """The items ``[lo, hi)`` whose windows start in a shard holding items ``[start, start + count)``.

    Windows are ``[k * window, (k + 1) * window)`` over the whole input; ``None`` when none starts
    in the shard.
    """
    lo = -(-start // window) * window
    if lo >= start + count:
        return None
    last = (start + count - 1) // window * window
    return lo, min(last + window, total)


# ---------------------------------------------------------------------- on disk
class Layout:
    """The files of a run's work directory (a local path or a URL); see the module docstrings."""

    def __init__(self, work: str) -> None:
        self.work = work

    def path(self, *parts: str) -> str:
        return storage.join(self.work, *parts)

    @property
    def config(self) -> str:
        return self.path("config.json")

    @property
    def progress(self) -> str:
        return self.path("progress.json")

    @property
    def shards(self) -> str:
        return self.path("plan", "shards.jsonl")

    @property
    def listing(self) -> str:
        return self.path("plan", "listing.json")

    @property
    def plan(self) -> str:
        return self.path("plan.json")

    def scan_items(self, shard: int) -> str:
        return self.path("plan", "scan", f"s{shard:06d}.jsonl")

    def scan_summary(self, shard: int) -> str:
        return self.path("plan", "scan", f"s{shard:06d}.json")

    def part_batches(self, part: int) -> str:
        return self.path("plan", "batches", f"p{part:06d}.jsonl")

    def part_summary(self, part: int) -> str:
        return self.path("plan", "batches", f"p{part:06d}.json")

    def shard_dir(self, part: int) -> str:
        return self.path("shards", f"p{part:06d}")

    def shard_prefix(self, part: int, batch: int, suffix: str = "") -> str:
        return storage.join(self.shard_dir(part), f"b{batch:07d}{suffix}")

    def record_dir(self, part: int) -> str:
        return self.path("records", f"p{part:06d}")

    def record(self, part: int, batch: int) -> str:
        return storage.join(self.record_dir(part), f"b{batch:07d}.json")

    def crashes(self, part: int, batch: int) -> str:
        """A batch run item by item after its worker died: the item in progress and the deaths per item."""
        return self.path("crashes", f"p{part:06d}", f"b{batch:07d}.json")

    def merged_prefix(self, part: int, suffix: str = "") -> str:
        return self.path("merged", f"p{part:06d}{suffix}")

    def merged_record(self, part: int) -> str:
        return self.path("merged", f"p{part:06d}.json")

    def iter_shards(self) -> Iterator[dict[str, Any]]:
        """The shard specs of ``plan/shards.jsonl``, streamed."""
        with storage.open_read(self.shards) as fh:
            for line in fh:
                yield json.loads(line)


def _jsonl(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


class ItemWriter:
    """The streaming writer of a shard's item file (``scan_shard``'s ``emit``)."""

    def __init__(self, url: str) -> None:
        self._out = storage.AtomicWriter(url)

    def __call__(self, item: Item) -> None:
        self._out.write(_jsonl(item.to_dict()))

    def commit(self) -> None:
        self._out.commit()

    def discard(self) -> None:
        self._out.discard()


def read_items(layout: Layout, shards: list[list[int]], lo: int, hi: int) -> Iterator[Item]:
    """Items ``[lo, hi)`` (global indices) from the item files of ``shards`` (``[shard, start, count]``)."""
    for shard, start, count in shards:
        if start + count <= lo or start >= hi:
            continue
        with storage.open_read(layout.scan_items(shard)) as fh:
            for k, line in enumerate(fh):
                g = start + k
                if g < lo:
                    continue
                if g >= hi:
                    break
                it = Item.from_dict(json.loads(line))
                it.index = g
                yield it


def write_part(layout: Layout, part: int, batches: Iterable[tuple[list[Item], list[Any] | None, int]],
               progress: Callable[[int], None] = lambda n: None) -> tuple[list[list[int]], int]:
    """Write a part's batch file; returns each line's ``[offset, length, items]`` and the item count."""
    lines: list[list[int]] = []
    n_items = 0
    with storage.AtomicWriter(layout.part_batches(part)) as out:
        for k, (items, shape, codes) in enumerate(batches):
            data = _jsonl({"batch": k, "shape": shape, "codes": codes, "items": [i.to_dict() for i in items]})
            lines.append([out.tell(), len(data), len(items)])
            out.write(data)
            n_items += len(items)
            progress(len(items))
    return lines, n_items


def batch_items(layout: Layout, ref: BatchRef) -> tuple[list[Item], list[Any] | None]:
    """The items of one batch (and its shape), read from its line of the part file: nothing else is read."""
    where = layout.part_batches(ref.part)
    d = json.loads(storage.read_bytes(where, ref.offset, ref.length))
    if d.get("batch") != ref.index or len(d.get("items", ())) != ref.items:
        raise ValueError(f"{where}: the line at byte {ref.offset} is not batch {ref.id}")
    return [Item.from_dict(i) for i in d["items"]], d.get("shape")
