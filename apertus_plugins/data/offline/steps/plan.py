"""The planning steps, one task each: scan a shard's headers, then batch one part of the plan."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from .. import storage
from ..faults import fault_point, worker_info
from ..plan import ItemWriter, cut_batches, read_items, window_batches, write_part
from ..sources import Item, scan_shard
from .context import RunContext

__all__ = ["ScanShard", "BatchPart"]


class ScanShard:
    """Scan one planning shard from headers: its item file, then its summary (the shard's checkpoint)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, shard: int, spec: dict[str, Any]) -> dict[str, Any]:
        layout = self.ctx.layout
        where = layout.scan_summary(shard)
        if storage.isfile(where):
            return storage.read_json(where)
        t0 = time.perf_counter()
        writer = ItemWriter(layout.scan_items(shard))
        try:
            found = scan_shard(spec, self.ctx.media, self.ctx.cfg.media_root, writer)
        except BaseException:
            writer.discard()
            raise
        writer.commit()
        summary = {"shard": shard, "items": found.items, "media": found.media,
                   "skipped": [asdict(s) for s in found.skips], "referenced": found.referenced,
                   "read": found.read, "seconds": round(time.perf_counter() - t0, 4), "worker": worker_info()}
        storage.write_json(where, summary)
        fault_point("plan-done", shard)
        return summary


class BatchPart:
    """Batch one part of the plan: the windows starting in shard ``part`` (pretrain) or its items (sft).

    ``shards``: ``[shard, first item, items]`` of the shards holding the part's items;
    ``window``: the part's items ``[lo, hi)`` (pretrain; ``None`` when no window starts in it).
    """

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, part: int, shards: list[list[int]], window: list[int] | None) -> dict[str, Any]:
        layout = self.ctx.layout
        where = layout.part_summary(part)
        if storage.isfile(where):
            return storage.read_json(where)
        t0 = time.perf_counter()
        consecutive = self.ctx.cfg.kind in ("sft", "interleaved")
        batches = self._consecutive(shards) if consecutive else self._windows(shards, window)
        lines, n_items = write_part(layout, part, batches)
        summary = {"part": part, "batches": len(lines), "items": n_items, "lines": lines,
                   "read": [layout.scan_items(s) for s, _a, n in shards if n],
                   "seconds": round(time.perf_counter() - t0, 4), "worker": worker_info()}
        storage.write_json(where, summary)
        return summary

    def _consecutive(self, shards: list[list[int]]) -> Iterator[tuple[list[Item], None, int]]:
        """SFT and interleaved: consecutive conversations (or recordings) of the part's one shard."""
        cfg = self.ctx.cfg
        (_s, start, count), = shards
        items = list(read_items(self.ctx.layout, shards, start, start + count))
        for run in cut_batches(((k, it.codes) for k, it in enumerate(items)), cfg.batch_size, cfg.batch_codes):
            yield [items[k] for k in run], None, sum(items[k].codes for k in run)

    def _windows(self, shards: list[list[int]], window: list[int] | None) -> Iterator[tuple[list[Item], Any, int]]:
        """Pretraining: the shape-uniform batches of each window of ``cfg.window`` items in ``[lo, hi)``."""
        if window is None:
            return
        cfg = self.ctx.cfg
        lo, hi = window
        buf: list[Item] = []
        for it in read_items(self.ctx.layout, shards, lo, hi):
            buf.append(it)
            if len(buf) == cfg.window:
                yield from self._window(buf)
                buf = []
        if buf:
            yield from self._window(buf)

    def _window(self, buf: list[Item]) -> Iterator[tuple[list[Item], Any, int]]:
        cfg = self.ctx.cfg
        for positions, shape, codes in window_batches(buf, cfg.batch_size, cfg.batch_codes,
                                                      cfg.audio_batching_settings()):
            yield [buf[p] for p in positions], shape, codes
