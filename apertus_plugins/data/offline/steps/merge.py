"""The merge step, one path for both merges: indexed datasets concatenated by megatron-core's builder.

:func:`concatenate` appends datasets with ``IndexedDatasetBuilder.add_index`` into a temporary
file (a ``.tmp`` beside a local destination, or a local temporary directory for a URL), flushes
it, and renames or uploads it whole. It is used to merge a part's batch shards
(:class:`MergePart`: into the work directory with ``merge="single"``, or as the part's final
dataset with ``merge="parts"``) and, with ``merge="single"``, to concatenate the merged parts
into the run's outputs (the driver's :func:`~..run._concat`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import storage
from ..faults import fault_point, fsync, worker_info
from .context import RunContext

__all__ = ["megatron_builder", "concatenate", "MergePart", "aggregate"]


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


def _nothing(*_args: Any) -> None:
    return None


def concatenate(sources: list[str], dest: str, dtype: str, *, check: Callable[[int, str], None] = _nothing,
                added: Callable[[int], None] = _nothing, inspect: Callable[[str], None] = _nothing) -> None:
    """The datasets ``sources`` (prefixes, local or URLs) appended in order into the dataset ``dest``.

    ``check(k, local_prefix)`` runs before the ``k``-th source is appended, ``added(k)`` right after
    (a progress bar, a fault point); ``inspect(local_target)`` reads the finished dataset before it
    is renamed or uploaded into place.
    """
    builder_cls = megatron_builder()
    tmp_dir = tempfile.mkdtemp(prefix="apertus-merge-")
    try:
        local = storage.is_local(dest)
        target = f"{storage.local_path(dest)}.tmp" if local else os.path.join(tmp_dir, "out")
        if local:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        builder = builder_cls(f"{target}.bin", dtype=np.dtype(dtype).type)
        with storage.local_copy([f"{s}{e}" for s in sources for e in (".bin", ".idx")]) as paths:
            for k in range(len(sources)):
                prefix = paths[2 * k][: -len(".bin")]
                check(k, prefix)
                builder.add_index(prefix)
                added(k)
        builder.finalize(f"{target}.idx")
        for ext in (".bin", ".idx"):
            fsync(f"{target}{ext}")
        inspect(target)
        for ext in (".bin", ".idx"):
            storage.upload(f"{target}{ext}", f"{dest}{ext}")
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


class MergePart:
    """Concatenate one part's batch shards, stream by stream; the part's summary is its checkpoint."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, part: int, first: int, count: int) -> dict[str, Any]:
        from apertus_plugins.core.media.image import dataset_image_layouts

        from ...indexed import IndexedDataset
        from ...manifest import describe_dataset

        ctx, layout = self.ctx, self.ctx.layout
        where = layout.merged_record(part)
        if storage.isfile(where):
            return storage.read_json(where)
        t0 = time.perf_counter()
        records = self._records(part, first, count)
        written = [r for r in records if r["documents"]]
        final = ctx.cfg.merge == "parts"
        entries: list[dict[str, Any]] = []
        layouts: set[str] = set()
        for stream in ctx.streams if written else []:
            dest = ctx.cfg.part_prefix(part, stream) if final else layout.merged_prefix(part, stream.suffix)
            shards = [layout.shard_prefix(part, r["batch"], stream.suffix) for r in written]

            def check(k: int, prefix: str, shards: list[str] = shards, suffix: str = stream.suffix) -> None:
                n = IndexedDataset(prefix).num_documents
                want = _documents(written[k], suffix)
                if n != want:
                    raise ValueError(f"{shards[k]}: {n} documents, its record says {want}")

            def inspect(target: str, stream: Any = stream, dest: str = dest) -> None:
                nonlocal layouts
                if stream.suffix == "":
                    layouts = dataset_image_layouts(IndexedDataset(target), ctx.spec, limit=64)
                if final:
                    entries.append(dict(describe_dataset(target), prefix=dest))

            concatenate(shards, dest, stream.dtype, check=check, inspect=inspect)
        summary = aggregate(records, ctx.streams, ctx.spec.modality_names)
        summary.update(part=part, documents=sum(r["documents"] for r in written),
                       stream_documents={s.suffix: sum(_documents(r, s.suffix) for r in written) for s in ctx.streams},
                       written_items=sum(len(r["items"]) for r in written), entries=entries, layouts=sorted(layouts),
                       merge_s=round(time.perf_counter() - t0, 4), worker=worker_info())
        storage.write_json(where, summary)
        fault_point("merge-part", part)
        return summary

    def _records(self, part: int, first: int, count: int) -> list[dict[str, Any]]:
        records = []
        for b in range(first, first + count):
            rec = self.ctx.layout.record(part, b)
            if not storage.isfile(rec):
                raise ValueError(f"{rec}: batch {b} has no record; it did not finish")
            records.append(storage.read_json(rec))
        return records


def _documents(record: dict[str, Any], suffix: str) -> int:
    """The documents a batch wrote to one stream (every stream gets every document, but in interleaved runs)."""
    return record.get("stream_documents", {}).get(suffix, record["documents"])


def aggregate(records: list[dict[str, Any]], streams: list[Any], names: list[str]) -> dict[str, Any]:
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
