"""The driver's planning stages as steps: list the inputs, count the lines of split JSONL files, scan
every shard, batch every part, and write ``plan.json`` (a typed :class:`~.plan.Plan`).

Each stage is a set of independent tasks on the run's executor; a resumed run skips those that
finished (a shard or part whose summary exists is read rather than sent again), after checking
that the settings and the listed inputs are unchanged. See :mod:`.plan` for the files.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import storage
from .config import TokenizeConfig, canonical_json
from .execute import Executor, RunError
from .plan import Layout, PartRow, Plan, part_windows
from .progress import Skipped, bar
from .sources import list_shards
from .worker import count_lines, plan_part, plan_shard

__all__ = ["PlanInfo", "Listing", "Planner", "listing_lines", "check_settings", "diff"]


@dataclass
class PlanInfo:
    """What planning cost: seconds, whether it was resumed, the scan's rate, the planning workers' peak memory."""

    plan_s: float
    plan_resumed: bool
    shards_resumed: int
    peak_rss_mb: float
    scan_s: float | None = None
    scan_items_per_s: float | None = None


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """The dotted keys where two JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [path]


def check_settings(found: dict[str, Any], cfg: TokenizeConfig, where: str) -> None:
    """A file of the work directory was made with the settings of ``cfg`` (else a :class:`RunError`)."""
    keys = diff(found, cfg.fingerprint())
    if keys:
        raise RunError(f"{where} was made with other settings ({', '.join(keys[:6])} differ); run with the same "
                       "settings to resume it, or pass --restart to discard it")


def listing_lines(cfg: TokenizeConfig) -> Iterator[bytes]:
    """The lines of ``plan/shards.jsonl``: one planning shard's spec each, from the inputs as they are now."""
    for spec in list_shards(cfg.kind, cfg.sources, cfg.plan_files, cfg.plan_bytes):
        yield (canonical_json(spec) + "\n").encode("utf-8")


@dataclass
class ScanTally:
    """The scan summaries of every shard, summed as they arrive."""

    counts: list[int]
    media: Counter[str] = field(default_factory=Counter)
    skipped: Skipped = field(default_factory=Skipped)
    referenced: dict[str, list[Any]] = field(default_factory=dict)
    resumed: int = 0
    planned: int = 0
    rss: float = 0.0

    def add(self, s: int, summary: dict[str, Any]) -> None:
        self.counts[s] = summary["items"]
        self.planned += summary["items"]
        self.media.update(summary["media"])
        self.skipped.add(summary["skipped"])
        for r in summary["referenced"]:
            self.referenced.setdefault(r[0], r)
        self.rss = max(self.rss, summary["worker"]["peak_rss_mb"])


class Listing:
    """The inputs cut into planning shards (``plan/shards.jsonl``, then ``plan/listing.json``), or, on
    resume, a check that the inputs still give the same shards."""

    def __init__(self, cfg: TokenizeConfig, layout: Layout) -> None:
        self.cfg, self.layout = cfg, layout

    def __call__(self) -> dict[str, Any]:
        """The planning shards of the inputs (``plan/shards.jsonl``), or a check that an earlier listing holds."""
        cfg, layout = self.cfg, self.layout
        if storage.isfile(layout.listing):
            listing = storage.read_json(layout.listing)
            check_settings(listing["fingerprint"], cfg, layout.listing)
            self._same_listing()
            return {**listing, "resumed": True}
        for sub in ("plan", "shards", "records", "merged"):  # leftovers without a listing cannot be trusted
            storage.remove(layout.path(sub), recursive=True)
        storage.remove(layout.plan)
        digest = hashlib.sha256()
        shards = files = 0
        with bar(cfg.progress, desc="list", unit=" shard") as b, storage.AtomicWriter(layout.shards) as out:
            for line in listing_lines(cfg):
                out.write(line)
                digest.update(line)
                shards += 1
                spec = json.loads(line)
                files += len(spec["files"]) if spec["kind"] == "files" else 1
                b.update(1)
        listing = {"fingerprint": cfg.fingerprint(), "shards": shards, "files": files, "sha256": digest.hexdigest()}
        storage.write_json(layout.listing, listing)
        return {**listing, "resumed": False}

    def _same_listing(self) -> None:
        where = self.layout.listing
        with storage.open_read(self.layout.shards) as fh:
            old = iter(fh)
            for n, line in enumerate(listing_lines(self.cfg)):
                before = next(old, b"")
                if line != before:
                    raise RunError(f"the inputs changed since {where} was made (planning shard {n}: "
                                   f"{_first_change(before, line)}); pass --restart to plan again")
            if next(old, None) is not None:
                raise RunError(f"the inputs changed since {where} was made (fewer files now); pass --restart to "
                               "plan again")


class Planner:
    """Plan a run (or resume its plan): :meth:`run` gives the :class:`Plan` and what planning cost."""

    def __init__(self, cfg: TokenizeConfig, layout: Layout, ex: Executor) -> None:
        self.cfg, self.layout, self.ex = cfg, layout, ex

    def run(self) -> tuple[Plan, PlanInfo]:
        t0 = time.perf_counter()
        listing = Listing(self.cfg, self.layout)()
        if storage.isfile(self.layout.plan):
            return self.resume(t0)
        splits = self.line_counts()
        t_scan = time.perf_counter()
        tally = self.scan(listing["shards"], splits)
        scan_s = time.perf_counter() - t_scan
        if self.cfg.checkpoint is None and tally.media:
            raise RunError(f"the inputs hold {' and '.join(sorted(tally.media))} items: pass --checkpoint DIR (the "
                           "media encoders)")
        parts, rss = self.batch(tally.counts)
        plan = self.assemble(listing, tally, parts)
        storage.write_json(self.layout.plan, plan.to_json())
        total = plan.total_items
        return plan, PlanInfo(time.perf_counter() - t0, False, tally.resumed, max(tally.rss, rss), round(scan_s, 3),
                              round(total / scan_s, 1) if scan_s > 0 else 0.0)

    def resume(self, t0: float) -> tuple[Plan, PlanInfo]:
        """The plan of an earlier run, checked against the settings and the media files it references."""
        where = self.layout.plan
        try:
            plan = Plan.from_json(storage.read_json(where), where)
        except ValueError as exc:
            raise RunError(f"{exc}; pass --restart") from None
        check_settings(plan.fingerprint, self.cfg, where)
        for path, *old in plan.referenced:  # media files named by conversations: still as the plan saw them
            if storage.stamp(path) != old:
                raise RunError(f"1 input file changed since {where} was made (e.g. {path}); pass --restart to plan "
                               "again")
        return plan, PlanInfo(time.perf_counter() - t0, True, plan.shards, 0.0)

    # ------------------------------------------------------------------ scanning
    def line_counts(self) -> dict[str, list[int]]:
        """JSONL files cut into several ranges: the lines of each range (the names of the next need them)."""
        layout = self.layout
        todo = {spec["path"] for s, spec in enumerate(layout.iter_shards())
                if spec["kind"] == "jsonl" and spec["parts"] > 1 and not storage.isfile(layout.scan_summary(s))}
        splits: dict[str, list[int]] = {}
        if not todo:
            return splits
        calls = [((spec["path"], spec["part"]), (spec["path"], *spec["range"])) for spec in layout.iter_shards()
                 if spec["kind"] == "jsonl" and spec["path"] in todo and spec["part"] < spec["parts"] - 1]

        def got_lines(key: tuple[str, int], lines: int) -> None:
            path, part = key
            row = splits.setdefault(path, [0] * (part + 1))
            row.extend([0] * (part + 1 - len(row)))
            row[part] = lines

        self.ex.map(count_lines, calls, got_lines, "counting the lines of")
        return splits

    def scan(self, n: int, splits: dict[str, list[int]]) -> ScanTally:
        """Every shard scanned by a task (a finished shard's summary is read instead)."""
        layout = self.layout
        tally = ScanTally([0] * n)
        with bar(self.cfg.progress, desc="plan", unit=" shard", total=n) as b:
            t_scan = time.perf_counter()
            tally.skipped.bar = b

            def scanned(s: int, summary: dict[str, Any]) -> None:
                tally.add(s, summary)
                b.update(1)
                rate = tally.planned / max(time.perf_counter() - t_scan, 1e-9)
                b.set_postfix_str(f"{tally.planned:,} items, {rate:,.0f} items/s, {tally.skipped.total:,} skipped",
                                  refresh=False)

            def todo() -> Iterator[tuple[int, tuple[Any, ...]]]:
                for s, spec in enumerate(layout.iter_shards()):
                    if storage.isfile(layout.scan_summary(s)):
                        tally.resumed += 1
                        scanned(s, storage.read_json(layout.scan_summary(s)))
                        continue
                    if spec["kind"] == "jsonl" and spec["part"]:
                        spec = dict(spec, first_line=1 + sum(splits[spec["path"]][: spec["part"]]))
                    yield s, (layout.work, s, spec)

            self.ex.map(plan_shard, todo(), scanned, "planning shard")
        return tally

    # ------------------------------------------------------------------ batching
    def part_args(self, p: int, counts: list[int], starts: list[int]) -> tuple[Any, ...]:
        """The arguments of part ``p``'s batching task: its shards' item ranges and its window of items."""
        work = self.layout.work
        if self.cfg.kind == "sft":
            return work, p, [[p, starts[p], counts[p]]], None
        window = part_windows(starts[p], counts[p], starts[-1], self.cfg.window)
        if window is None:
            return work, p, [], None
        lo, hi = window
        first = bisect.bisect_right(starts, lo) - 1
        shards = [[s, starts[s], counts[s]] for s in range(first, len(counts)) if starts[s] < hi and counts[s]]
        return work, p, shards, list(window)

    def batch(self, counts: list[int]) -> tuple[list[PartRow], float]:
        """Every part batched by a task; the parts table and the tasks' peak memory."""
        layout, n = self.layout, len(counts)
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        rows: list[tuple[int, int]] = [(0, 0)] * n  # batches, items
        rss = 0.0
        with bar(self.cfg.progress, desc="batch", unit=" part", total=n) as b:
            def batched(p: int, summary: dict[str, Any]) -> None:
                nonlocal rss
                rows[p] = (summary["batches"], summary["items"])
                rss = max(rss, summary["worker"]["peak_rss_mb"])
                b.update(1)

            def todo() -> Iterator[tuple[int, tuple[Any, ...]]]:
                for p in range(n):
                    if storage.isfile(layout.part_summary(p)):
                        batched(p, storage.read_json(layout.part_summary(p)))
                    else:
                        yield p, self.part_args(p, counts, starts)

            self.ex.map(plan_part, todo(), batched, "batching part")
        firsts = np.concatenate([[0], np.cumsum([r[0] for r in rows], dtype=np.int64)]).tolist()
        parts = [PartRow(firsts[p], *rows[p]) for p in range(n)]
        found = sum(r.items for r in parts)
        if found != starts[-1]:
            raise RunError(f"{layout.work}: the plan's parts hold {found} items, the scan found {starts[-1]}; pass "
                           "--restart")
        return parts, rss

    def assemble(self, listing: dict[str, Any], tally: ScanTally, parts: list[PartRow]) -> Plan:
        skipped = tally.skipped
        return Plan(fingerprint=self.cfg.fingerprint(), kind=self.cfg.kind, shards=listing["shards"],
                    files=listing["files"], listing_sha256=listing["sha256"], total_items=sum(tally.counts),
                    plan_skipped=skipped.total, plan_skipped_by_reason=dict(sorted(skipped.counts.items())),
                    plan_skipped_latest=list(skipped.latest), media=dict(sorted(tally.media.items())),
                    batches=sum(r.batches for r in parts), parts=parts, referenced=list(tally.referenced.values()))


def _first_change(before: bytes, now: bytes) -> str:
    """The first file whose listing entry differs between two versions of a shard spec."""
    try:
        a, b = json.loads(before), json.loads(now)
    except ValueError:
        return "its listing differs"
    fa = a.get("files") or [[a.get("path"), a.get("name"), a.get("stamp")]]
    fb = b.get("files") or [[b.get("path"), b.get("name"), b.get("stamp")]]
    for x, y in zip(fa, fb, strict=False):
        if x != y:
            return f"e.g. {x[1] if x else y[1]} changed"
    return f"e.g. {(fa or fb)[-1][1]} was added or removed"
