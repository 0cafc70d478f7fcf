"""The write step: a batch's documents as one indexed dataset per stream, then its record (the commit).

The shards (``WORK/shards/pNNNNNN/bNNNNNNN{suffix}.bin/.idx``) are written with the core's numpy
writer under temporary names and renamed (or uploaded) whole: byte-identical to megatron-core's
builder, and it keeps torch and megatron-core out of text-only workers. The record
(``WORK/records/pNNNNNN/bNNNNNNN.json``: the items written, the items skipped with reasons, token
counts, timings, what it read) is written atomically, last: a batch without one did not happen.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from .. import storage
from ..faults import fault_point, faults_armed, fsync, worker_info
from ..plan import BatchRef
from .context import RunContext
from .records import Decoded, Encoded, Packed

__all__ = ["Write"]


class Write:
    """Write a packed batch's shards and commit its record."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, dec: Decoded, enc: Encoded, packed: Packed, pack_s: float) -> dict[str, Any]:
        """The batch's shards and record (``pack_s``: seconds spent packing, counted as writing)."""
        t0 = time.perf_counter()
        ref, docs, skips = dec.ref, packed.docs, packed.skips
        tokens = self.shards(ref, docs)
        by_index = {it.index: it for it in dec.items}
        kinds = sorted({m.kind for it in dec.items for m in it.media})
        written = sorted({i for i, _ in docs})  # an interleaved recording may give several documents
        write_s = pack_s + time.perf_counter() - t0
        record = {
            "batch": ref.id,
            "part": ref.part,
            "documents": len(docs),
            "stream_documents": {s.suffix: sum(1 for _i, d in docs if s.suffix in d) for s in self.ctx.streams},
            "items": written,
            "skipped": [asdict(skips[i]) for i in sorted(skips)],
            "tokens": tokens,
            "media": {k: sum(1 for i in written for m in by_index[i].media if m.kind == k) for k in kinds},
            "seconds": round(dec.decode_s + enc.encode_s + write_s, 4),
            "decode_s": round(dec.decode_s, 4),
            "encode_s": round(enc.encode_s, 4),
            "write_s": round(write_s, 4),
            "device": enc.device,
            "read": dec.read,
            "worker": worker_info(),
            "encoder": enc.encoder,
        }
        if enc.media_cache:
            record["media_cache"] = enc.media_cache
        storage.write_json(self.ctx.layout.record(ref.part, ref.id), record)
        fault_point("batch-done", ref.id)
        return record

    def shards(self, ref: BatchRef, docs: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, dict[str, int]]:
        """Write the batch's shard of every stream atomically; token counts per stream and modality."""
        from ...indexed import IndexedDatasetWriter

        spec, streams, layout = self.ctx.spec, self.ctx.streams, self.ctx.layout
        names = spec.modality_names
        tokens: dict[str, dict[str, int]] = {}
        if not docs:
            return {s.suffix: dict.fromkeys(names, 0) for s in streams if s.dtype == "int32"}
        local = storage.is_local(layout.work)
        tmp_dir = None if local else tempfile.mkdtemp(prefix="apertus-shard-")
        try:
            for n, stream in enumerate(streams):
                final = layout.shard_prefix(ref.part, ref.id, stream.suffix)
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
                            counts += np.bincount(spec.modality_of(arr), minlength=len(names))[: len(names)]
                        if n == 0 and k == len(docs) // 2 and faults_armed():
                            writer._fh.flush()
                            fault_point("batch-mid", ref.id)
                except BaseException:
                    writer.abort()
                    raise
                writer.finalize()  # temporary names, then renamed into place
                for ext in (".bin", ".idx"):
                    fsync(f"{target}{ext}")
                    if not local:
                        storage.upload(f"{target}{ext}", f"{final}{ext}")
                if stream.dtype == "int32":
                    tokens[stream.suffix] = {name: int(c) for name, c in zip(names, counts, strict=True)}
        finally:
            if tmp_dir:
                shutil.rmtree(tmp_dir, ignore_errors=True)
        return tokens
