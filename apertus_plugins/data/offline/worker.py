"""The tasks of a run, as plain functions that local processes, Ray tasks and Ray actors execute.

Each task is one step of :mod:`.steps` on one unit of work, in this process's
:class:`WorkerContext` (built once per process and work directory):

* planning: :func:`plan_shard` (:class:`~.steps.ScanShard`), :func:`count_lines`,
  :func:`plan_part` (:class:`~.steps.BatchPart`);
* a batch: :func:`run_batch` (read -> preprocess -> encode -> pack -> write in one process,
  :class:`~.steps.RunBatch`), or, on Ray, :func:`decode_batch` (read and preprocess on a CPU),
  the encode step on an encoder actor and :func:`write_batch` (pack and write);
  :func:`run_batch_careful` (a batch whose worker died, item by item);
* merging: :func:`merge_part` (:class:`~.steps.MergePart`).

A batch is idempotent: one whose record exists is not redone. The record is the batch's
checkpoint: a batch without one did not happen, and a resumed run redoes it from scratch, so a
kill at any moment loses at most the batches in flight. Whatever one item raises costs only that
item: it is skipped with its reason and the stage that found it. Fault points for tests and
drills (``APERTUS_TOKENIZE_FAULT``): see :mod:`.faults`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import storage
from .faults import CRASHES, FAULT_ENV, PGID_ENV, fault_point, peak_rss_mb
from .plan import BatchRef, Layout
from .sources import Item, MediaRef, line_starts
from .steps import BatchPart, MergePart, RunBatch, RunContext, ScanShard
from .steps.merge import megatron_builder
from .steps.records import Arrays, Decoded, Encoded

__all__ = ["FAULT_ENV", "PGID_ENV", "CRASHES", "fault_point", "WorkerContext", "context", "Decoded", "Encoded",
           "plan_shard", "plan_part", "count_lines", "decode_batch", "encode_batch", "write_batch", "run_batch", "run_batch_careful",
           "merge_part", "peak_rss_mb", "megatron_builder"]


class WorkerContext(RunContext):
    """A worker process's run: the shared context, and each step of the pipeline as its own object."""

    def __init__(self, work: str) -> None:
        super().__init__(work)
        self.plan_shard = ScanShard(self)
        self.plan_part = BatchPart(self)
        self.batch = RunBatch(self)
        self.merge_part = MergePart(self)

    # a batch, step by step (see :class:`~.steps.RunBatch`)
    def done(self, ref: BatchRef) -> dict[str, Any] | None:
        return self.batch.done(ref)

    def decode(self, ref: BatchRef) -> Decoded:
        return self.batch.decode(ref)

    def encode(self, arrays: Arrays) -> dict[str, Any]:
        """The encode step's result as a dict (``codes``, ``failed``, ``encode_s``...; see :class:`Encoded`)."""
        return self.batch.encode(arrays).as_dict()

    def write(self, dec: Decoded, enc: Encoded | None) -> dict[str, Any]:
        return self.batch.finish(dec, enc)

    def run(self, ref: BatchRef) -> dict[str, Any]:
        return self.batch(ref)

    def run_careful(self, ref: BatchRef) -> dict[str, Any]:
        return self.batch.careful(ref)

    # single items, for tools and tests
    def load(self, ref: MediaRef, record: tuple[list[dict[str, Any]], str] | None = None) -> np.ndarray:
        return self.batch.preprocess.load(ref, record)

    def sequence(self, kind: str, codes: np.ndarray) -> np.ndarray:
        return self.batch.pack.sequence(kind, codes)

    def pretrain_document(self, item: Item, codes: np.ndarray) -> np.ndarray:
        return self.batch.pack.pretrain_document(item, codes)


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
    return context(work).batch(ref)


def run_batch_careful(work: str, ref: BatchRef) -> dict[str, Any]:
    """Run one batch whose worker process died, item by item (:meth:`~.steps.RunBatch.careful`)."""
    return context(work).batch.careful(ref)


def decode_batch(work: str, ref: BatchRef) -> tuple[Arrays, Decoded | dict[str, Any]]:
    """The CPU steps of a batch: ``(arrays by modality, the rest)``; a finished batch gives ``({}, its record)``."""
    batch = context(work).batch
    done = batch.done(ref)
    if done is not None:
        return {}, done
    dec = batch.decode(ref)
    return dec.arrays, dec.without_arrays()


def encode_batch(work: str, arrays: Arrays) -> Encoded:
    """The encode step of a batch (an encoder actor's call)."""
    return context(work).batch.encode(arrays)


def write_batch(work: str, dec: Decoded, enc: Encoded | None) -> dict[str, Any]:
    """The last steps of a batch: documents, shards, record."""
    return context(work).batch.finish(dec, enc)


def merge_part(work: str, part: int, first: int, count: int) -> dict[str, Any]:
    """Merge one part's batch shards (idempotent); returns the part's summary."""
    return context(work).merge_part(part, first, count)
