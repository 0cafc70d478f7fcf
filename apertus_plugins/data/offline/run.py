"""The driver: list, plan, encode and merge as parallel tasks (or resume them); manifest and report.

Layout on disk for ``--out OUT`` (a local path or a URL of any fsspec filesystem)::

    OUT.bin, OUT.idx                 the merged dataset (int32 ids, one sequence per document)
    OUT.partNNNNNN.bin/.idx          --merge parts: one dataset per plan part instead, in order
    OUT.manifest.json                the core's manifest of OUT (or of its parts, in order), with how
                                     it was made under "metadata"
    OUT.mask.bin/.idx                sft, --mask-stream: the token-aligned loss mask (uint8), in OUT's manifest
    OUT.noreason.bin/.idx            sft, --without-reasoning: the copy without reasoning spans
    OUT.noreason.mask.bin/.idx       both of the above
    OUT.noreason.manifest.json       the copy's manifest (with its mask stream)
    OUT.long.bin/.idx, .manifest.json  interleaved, --split-tokens N: the documents longer than N tokens
    OUT.data-args.txt                --merge parts: the parts with token-count weights, for Megatron-LM's
                                     --data-args-path (and OUT.noreason.data-args.txt)
    OUT.report.json                  the summary report (items written, skipped with reasons, tokens, timing);
                                     "status": "stopped" when --max-bad-fraction stopped the run
    OUT.work/                        while running (removed after success unless --keep-work):
        lock                         held by the running driver (flock; local work directories)
        config.json                  the run's settings, read by every worker
        progress.json                the progress view (items/s, encoder utilisation, skips, ETA)
        plan/, plan.json             the plan, as per-shard files (see :mod:`.plan`)
        shards/pNNNNNN/bNNNNNNN*.bin/.idx    one Megatron indexed dataset per batch and stream
        records/pNNNNNN/bNNNNNNN.json        a batch's checkpoint: written last, after its shards
        merged/pNNNNNN*.bin/.idx, .json      a part's merged shards and its record (--merge single)

The stages, each a set of independent tasks that a resumed run skips where they finished:
listing (the driver streams the inputs into planning shards), scanning and batching (a task per
shard), encoding (a task, or a decode task, an encoder actor call and a write task, per batch)
and merging (a task per part, then, for a single output, one concatenation of the parts). The
merged bytes depend only on the plan, so they equal those of an uninterrupted run with any worker
count, local or on Ray. No process holds the plan whole: the driver holds a table with a row per
shard, and each task reads only its own slice.

Planning is :class:`.planner.Planner`; each task is a step of :mod:`.steps` run by :mod:`.worker`.
A bad item costs only itself: whatever one item raises while it is planned, decoded, encoded or
made a document skips that item, recorded in its shard's summary or its batch's
record, so a resumed run does not try it again. :class:`BadFraction` stops a run whose inputs are
mostly broken (``--max-bad-fraction``), with a report of what was skipped so far.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from apertus_plugins.data.offline import storage

from .config import TokenizeConfig
from .execute import Executor, RunError, make_executor
from .faults import fault_point, peak_rss_mb
from .plan import BatchRef, Layout, Plan
from .planner import PlanInfo, Planner, diff, listing_lines
from .progress import Progress, Skipped, bar
from .steps.merge import concatenate
from .worker import merge_part

__all__ = ["REPORT_FORMAT", "RunError", "tokenize", "format_report"]

REPORT_FORMAT = "apertus-tokenize-report"
REPORT_VERSION = 2


@contextlib.contextmanager
def _lock(work: str) -> Iterator[None]:
    if not storage.is_local(work):  # object stores have no locks: one run per work directory
        storage.makedirs(work)
        yield
        return
    path = storage.local_path(work)
    os.makedirs(path, exist_ok=True)
    fh = open(os.path.join(path, "lock"), "a+")  # noqa: SIM115 (closed below)
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"{work}: another apertus tokenize run is using this work directory") from None
        yield
    finally:
        fh.close()


def _memory_check(cfg: TokenizeConfig) -> None:
    urls = [*cfg.sources, cfg.out, cfg.work]
    if any(storage.protocol(u) == "memory" for u in urls) and (cfg.workers or cfg.ray_address):
        raise RunError("memory:// is a filesystem inside one process: run with --workers 0")


# ---------------------------------------------------------------------- planning
def _plan(cfg: TokenizeConfig, layout: Layout, ex: Executor) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan as ``plan.json`` holds it and what planning cost, as dicts (see :class:`.planner.Planner`)."""
    plan, info = Planner(cfg, layout, ex).run()
    return plan.to_json(), asdict(info)


def _plan_summary(cfg: TokenizeConfig, layout: Layout, plan: Plan, info: PlanInfo,
                  out: Any) -> dict[str, Any]:
    """``--plan-only``: what the plan holds and what planning cost (printed and returned)."""
    skipped = Counter[str]()
    for s in range(plan.shards):
        skipped.update(k["reason"] for k in storage.read_json(layout.scan_summary(s))["skipped"])
    summary = {"work": cfg.work, "shards": plan.shards, "files": plan.files, "items": plan.total_items,
               "batches": plan.batches, "parts": sum(1 for _f, n, _i in plan.parts if n),
               "media": plan.media, "skipped_by_reason": dict(sorted(skipped.items())),
               "plan_s": round(info.plan_s, 3), "plan_resumed": info.plan_resumed,
               "scan_items_per_s": info.scan_items_per_s,
               "peak_rss_mb": {"driver": peak_rss_mb(), "planning": info.peak_rss_mb}}
    storage.write_json(layout.path("plan-summary.json"), summary)
    print(f"planned {summary['items']:,} items from {summary['files']:,} files in {summary['shards']:,} shards: "
          f"{summary['batches']:,} batches in {summary['parts']:,} parts, {sum(skipped.values()):,} skipped; "
          f"{summary['plan_s']:.1f} s; the plan is in {cfg.work}", file=out)
    return summary


# ---------------------------------------------------------------------- encoding
def _done_batches(layout: Layout, part: int) -> set[int]:
    return {int(n[1:8]) for n in storage.listdir(layout.record_dir(part)) if n.startswith("b") and n.endswith(".json")}


class BadFraction:
    """``--max-bad-fraction``: whether a run's inputs are too broken to go on (see :class:`TokenizeConfig`).

    ``total`` counts every input item (planned, and skipped while planning). The run stops as soon
    as the items skipped so far are more than ``limit`` of ``total`` (whatever the rest holds), or,
    once :data:`SAMPLE` planned items (or all, when fewer) were decoded and encoded, as soon as the
    share skipped among them, projected onto every planned item, takes the whole run above ``limit``.
    """

    #: planned items processed before a projection may stop a run
    SAMPLE = 1000

    def __init__(self, limit: float, planned: int, plan_skipped: int) -> None:
        self.limit, self.planned, self.plan_skipped = float(limit), planned, plan_skipped
        self.total = planned + plan_skipped
        self.seen = self.skipped = 0  # planned items processed, and skipped among them

    def add(self, items: int, skipped: int) -> None:
        self.seen += items
        self.skipped += skipped

    def exceeded(self) -> str | None:
        """Why the run must stop, or ``None``."""
        if self.limit >= 1.0 or not self.total:
            return None
        bad = self.plan_skipped + self.skipped
        if bad > self.limit * self.total:
            return f"{bad:,} of the {self.total:,} input items are skipped ({bad / self.total:.1%})"
        if self.seen and self.seen >= min(self.SAMPLE, self.planned):
            projected = (self.plan_skipped + self.skipped / self.seen * self.planned) / self.total
            if projected > self.limit:
                return (f"{self.skipped:,} of the first {self.seen:,} items encoded were skipped, with the "
                        f"{self.plan_skipped:,} skipped while planning: {projected:.1%} of the {self.total:,} input "
                        "items projected")
        return None


class StopRun(RunError):
    """The run stopped on ``--max-bad-fraction`` (the driver writes the report and says why)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _plan_skips(layout: Layout, plan: Plan) -> Skipped:
    """The plan stage's skipped items (from plan.json, or from the scan summaries of an older plan)."""
    if plan.plan_skipped_by_reason is not None:
        return Skipped(counts=plan.plan_skipped_by_reason, latest=plan.plan_skipped_latest)
    out = Skipped()
    for s in range(plan.shards):
        out.add(storage.read_json(layout.scan_summary(s))["skipped"])
    return out


def _encode(cfg: TokenizeConfig, layout: Layout, plan: Plan, ex: Executor) -> dict[str, Any]:
    if storage.is_local(layout.work):  # a batch killed mid-write leaves temporary files: never trusted
        shards = storage.local_path(layout.path("shards"))
        for root, _dirs, names in os.walk(shards):
            for name in names:
                if ".tmp" in name:
                    os.unlink(os.path.join(root, name))
    skipped = _plan_skips(layout, plan)
    budget = BadFraction(cfg.max_bad_fraction, plan.total_items, plan.plan_skipped)
    done_items = done_batches = 0
    todo_parts = []
    for p, (_first, n, _items) in enumerate(plan.parts):
        if not n:
            continue
        done = _done_batches(layout, p)
        if len(done) < n:
            todo_parts.append(p)
        for b in sorted(done):  # batches of an earlier run: their skips count (and are not named again)
            record = storage.read_json(layout.record(p, b))
            skipped.add(record["skipped"])
            budget.add(len(record["items"]) + len(record["skipped"]), len(record["skipped"]))
            done_items += len(record["items"]) + len(record["skipped"])
            done_batches += 1
    why = budget.exceeded()
    if why:
        raise StopRun(why)

    def refs() -> Iterator[BatchRef]:
        for p in todo_parts:
            first, n, _items = plan.parts[p]
            lines = storage.read_json(layout.part_summary(p))["lines"]
            done = _done_batches(layout, p)
            for k in range(n):
                if first + k not in done:
                    off, length, items = lines[k]
                    yield BatchRef(first + k, p, k, off, length, items)

    progress = Progress(layout.progress, plan.total_items, done_items, ex.encoders, cfg.progress, skipped)
    devices: set[str] = set()
    rss = {"decode": 0.0, "encode": 0.0}
    new = 0

    def on_done(record: dict[str, Any]) -> None:
        nonlocal new
        new += 1
        if record.get("device"):
            devices.add(record["device"])
        rss["decode"] = max(rss["decode"], record["worker"]["peak_rss_mb"])
        if record.get("encoder"):
            rss["encode"] = max(rss["encode"], record["encoder"]["peak_rss_mb"])
        items = len(record["items"]) + len(record["skipped"])
        progress.update(record, items)
        budget.add(items, len(record["skipped"]))
        why = budget.exceeded()
        if why:
            raise StopRun(why)

    t0 = time.perf_counter()
    try:
        ex.batches(layout.work, refs(), on_done, encode=bool(plan.media))
    finally:
        stats = progress.close()
    return {"encode_s": time.perf_counter() - t0, "batches_resumed": done_batches, "batches_run": new,
            "devices": sorted(devices), "progress": stats, "peak_rss_mb": rss}


# ---------------------------------------------------------------------- merge
def _merge_parts(cfg: TokenizeConfig, layout: Layout, plan: Plan, ex: Executor) -> dict[str, Any]:
    """Every part's batch shards merged by its own task; the sums of their records."""
    calls = [(p, (layout.work, p, first, n)) for p, (first, n, _i) in enumerate(plan.parts) if n]
    summaries: dict[int, dict[str, Any]] = {}
    resumed = sum(1 for p, _a in calls if storage.isfile(layout.merged_record(p)))
    with bar(cfg.progress, desc="merge", unit=" part", total=len(calls)) as b:
        def merged(p: int, summary: dict[str, Any]) -> None:
            summaries[p] = {k: v for k, v in summary.items() if k != "worker"}
            summaries[p]["peak_rss_mb"] = summary["worker"]["peak_rss_mb"]
            b.update(1)

        ex.map(merge_part, calls, merged, "merging part")
    return {"parts": [summaries[p] for p in sorted(summaries)], "parts_resumed": resumed}


def _concat(cfg: TokenizeConfig, layout: Layout, parts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``single``: the merged parts, in plan order, into one dataset per stream (:func:`.steps.concatenate`,
    the merge path of the parts too); the manifest entries of the outputs that are not local."""
    from apertus_plugins.data.manifest import describe_dataset

    written = [s for s in parts if s["documents"]]
    entries: dict[str, dict[str, Any]] = {}
    total = sum(s["documents"] for s in parts) * len(cfg.streams())
    with bar(cfg.progress, desc="write", unit=" doc", total=total) as b:
        for n, stream in enumerate(cfg.streams()):
            final = cfg.prefix(stream)

            def added(k: int, first: bool = n == 0) -> None:
                b.update(written[k]["documents"])
                if first:
                    fault_point("merge-mid", k + 1)

            def inspect(target: str, final: str = final) -> None:
                if not storage.is_local(final):
                    entries[final] = dict(describe_dataset(target), prefix=final)

            concatenate([layout.merged_prefix(s["part"], stream.suffix) for s in written], final, stream.dtype,
                         added=added, inspect=inspect)
    return entries


def _check_layout(cfg: TokenizeConfig, parts: list[dict[str, Any]]) -> None:
    """The image layout found in each part's first documents with images (a mixed or foreign layout raises)."""
    found = {layout for s in parts for layout in s["layouts"]}
    if found - {cfg.image_layout}:
        raise RunError(f"{cfg.out}: documents use the {', '.join(sorted(found))} image layout, the run asked for "
                       f"{cfg.image_layout}")


def _manifests(cfg: TokenizeConfig, spec: Any, parts: list[dict[str, Any]], remote: dict[str, dict[str, Any]]) -> None:
    from apertus_plugins.data.manifest import manifest_document, write_manifest

    for path, streams in cfg.manifests().items():
        if cfg.merge == "single" and storage.is_local(path):
            write_manifest([cfg.prefix(s) for s in streams], storage.local_path(path),
                           metadata={cfg.prefix(s): _metadata(cfg, s.suffix, spec) for s in streams})
            continue
        entries = []
        if cfg.merge == "single":
            for s in streams:
                entries.append(dict(remote[cfg.prefix(s)], metadata=_metadata(cfg, s.suffix, spec)))
        else:
            by_prefix = {e["prefix"]: e for part in parts for e in part["entries"]}
            for part in parts:
                if not part["documents"]:
                    continue
                for s in streams:
                    entry = by_prefix[cfg.part_prefix(part["part"], s)]
                    entries.append(dict(entry, metadata=dict(_metadata(cfg, s.suffix, spec), part=part["part"])))
        storage.write_json(path, manifest_document(entries), indent=2)
        if cfg.merge == "parts":
            _data_args(cfg, path, streams[0], entries)


def _data_args(cfg: TokenizeConfig, manifest: str, stream: Any, entries: list[dict[str, Any]]) -> None:
    """``--merge parts``: the file Megatron-LM reads with ``--data-args-path`` beside the manifest.

    Megatron-LM splits the file on whitespace and reads it as ``--data-path`` (``WEIGHT PREFIX``
    pairs, ``get_blend_from_list``); here one pair a line, the weight being the part's token count
    (Megatron normalises the weights), the prefixes in plan order, the token stream's only (a mask
    stream is found by its suffix, as ``--apertus-sft-mask stored`` reads it).
    """
    lines = [f"{e['tokens']} {e['prefix']}\n" for e in entries
             if e["prefix"] == cfg.part_prefix(e["metadata"]["part"], stream)]
    storage.write_bytes(cfg.data_args_path(manifest), "".join(lines).encode("utf-8"))


_AUDIO_PADDING = {
    "exact": "none (clips are batched only with clips of identical length; no codes dropped)",
    "report": "report 2.3.2: clips padded to the longest of their duration-bucketed batch; the last five codes "
              "of a padded clip dropped",
}


def _metadata(cfg: TokenizeConfig, stream_suffix: str, spec: Any) -> dict[str, Any]:
    from apertus_plugins.plugins import serving_layout

    serving = serving_layout("image")
    fp = cfg.fingerprint()
    meta: dict[str, Any] = {
        "producer": "apertus tokenize",
        "kind": cfg.kind,
        "stream": {s.suffix: s.what for s in cfg.streams()}[stream_suffix],
        "dtype": {s.suffix: s.dtype for s in cfg.streams()}[stream_suffix],
        "one_sequence_per_document": True,
        "image_layout": cfg.image_layout,
        "serving_image_layout": serving,
        "resize_policy": cfg.resize_policy,
        "audio_policy": cfg.audio_policy,
        "audio_padding": _AUDIO_PADDING[cfg.audio_batching],
        "tokenizer": fp["settings"]["tokenizer"],
        "tokenizer_sha256": fp["tokenizer_sha256"],
        "checkpoint": fp["settings"]["checkpoint"],
        "precision": cfg.precision,
        "vocab": {"total": spec.size, "modalities": spec.summary()["modalities"]},
    }
    if cfg.audio_batching == "report":
        meta.update(audio_batch_seconds=cfg.audio_batch_seconds, audio_buckets=cfg.audio_buckets)
    if cfg.kind == "pretrain":
        meta.update(bos=cfg.bos, eos=cfg.eos, audio_task=cfg.audio_task, captions=cfg.captions)
    elif cfg.kind == "interleaved":
        meta.update(bos=cfg.bos, eos=cfg.eos, sequences="interleaved speech-text (report 2.2.4)",
                    split_tokens=cfg.split_tokens)
    else:
        meta.update(chat_variant="training", reasoning="removed" if ".noreason" in stream_suffix else "kept")
    return meta


# ---------------------------------------------------------------------- report
def _report(cfg: TokenizeConfig, layout: Layout, plan: Plan, parts: list[dict[str, Any]], spec: Any,
            timing: dict[str, Any]) -> dict[str, Any]:
    from apertus_plugins.plugins import serving_layout

    skipped: list[dict[str, Any]] = []
    for s in range(plan.shards):
        skipped.extend(storage.read_json(layout.scan_summary(s))["skipped"])
    for part in parts:
        skipped.extend(part["skipped"])
    written = sum(p.get("written_items", p["documents"]) for p in parts)
    names = spec.modality_names
    outputs: dict[str, Any] = {}
    for s in cfg.streams():
        docs = sum(p.get("stream_documents", {}).get(s.suffix, p["documents"]) for p in parts)
        entry: dict[str, Any] = {"documents": docs, "dtype": s.dtype, "what": s.what}
        if s.dtype == "int32":
            tok = {n: sum(p["tokens"].get(s.suffix, {}).get(n, 0) for p in parts) for n in names}
            entry["tokens"] = dict(tok, total=sum(tok.values()))
        if cfg.merge == "parts":
            entry["parts"] = [cfg.part_prefix(p["part"], s) for p in parts if p["documents"]]
            if s.dtype == "int32":
                entry["data_args"] = cfg.data_args_path(f"{cfg.prefix(s)}.manifest.json")
        outputs[cfg.prefix(s)] = entry
    media: Counter[str] = Counter()
    for p in parts:
        media.update(p["media"])
    serving = serving_layout("image")
    note = None
    if media.get("image") and cfg.image_layout != serving:
        note = (f"images are in the {cfg.image_layout} layout; serving (the released processor) uses the {serving} "
                "layout (SPEC.md 2.1). The manifest records the layout; pass --image-layout "
                f"{serving} for data that matches serving.")
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "status": "complete",
        "kind": cfg.kind,
        "outputs": outputs,
        "items": {"total": plan.total_items + plan.plan_skipped, "written": written, "skipped": len(skipped)},
        "skipped_by_reason": dict(sorted(Counter(s["reason"] for s in skipped).items())),
        "skipped": skipped,
        "tokens": outputs[cfg.prefix(cfg.streams()[0])].get("tokens", {}),
        "media": dict(sorted(media.items())),
        "image_layout": cfg.image_layout,
        "layout_note": note,
        "run": timing,
        "fingerprint": plan.fingerprint,
        "inputs": {"shards": plan.shards, "files": plan.files, "listing_sha256": plan.listing_sha256,
                   "referenced": plan.referenced},
    }


def _stopped(cfg: TokenizeConfig, layout: Layout, plan: Plan, why: str) -> dict[str, Any]:
    """The report of a run stopped on ``--max-bad-fraction`` (written to ``OUT.report.json``): every item
    skipped so far, by name, with the counts; no outputs."""
    skipped: list[dict[str, Any]] = []
    for s in range(plan.shards):
        skipped.extend(storage.read_json(layout.scan_summary(s))["skipped"])
    processed = written = 0
    for p, (_first, n, _items) in enumerate(plan.parts):
        for b in sorted(_done_batches(layout, p)) if n else ():
            record = storage.read_json(layout.record(p, b))
            skipped.extend(record["skipped"])
            processed += len(record["items"]) + len(record["skipped"])
            written += len(record["items"])
    report = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "status": "stopped",
        "stopped": {"why": why, "max_bad_fraction": cfg.max_bad_fraction},
        "kind": cfg.kind,
        "outputs": {},
        "items": {"total": plan.total_items + plan.plan_skipped, "encoded": written, "skipped": len(skipped),
                  "not_processed": plan.total_items - processed},
        "skipped_by_reason": dict(sorted(Counter(s["reason"] for s in skipped).items())),
        "skipped": skipped,
        "fingerprint": plan.fingerprint,
        "inputs": {"shards": plan.shards, "files": plan.files, "listing_sha256": plan.listing_sha256,
                   "referenced": plan.referenced},
    }
    storage.write_json(cfg.report_path, report)
    return report


def format_report(report: dict[str, Any], limit: int = 20) -> str:
    """The summary printed at the end of a run (or where it stopped)."""
    items = report["items"]
    lines = []
    for prefix, o in report["outputs"].items():
        tok = o.get("tokens", {})
        extra = f", {tok.get('total', 0):,} tokens" if tok else ""
        where = f"{len(o['parts'])} parts {prefix}.partNNNNNN" if "parts" in o else prefix
        lines.append(f"wrote {where}.bin/.idx: {o['documents']:,} documents{extra} ({o['what']})")
        if o.get("data_args"):
            lines.append(f"  Megatron: --data-args-path {o['data_args']} (a weight and a prefix per part)")
    if report.get("status") == "stopped":
        lines.append(f"stopped: {report['stopped']['why']} (--max-bad-fraction {report['stopped']['max_bad_fraction']:g})")
        lines.append(f"items: {items['total']:,} in the inputs, {items['encoded']:,} encoded, {items['skipped']:,} "
                     f"skipped, {items['not_processed']:,} not processed; nothing written")
    else:
        lines.append(f"items: {items['total']:,} in the inputs, {items['written']:,} written, {items['skipped']:,} "
                     "skipped")
    if report["skipped_by_reason"]:
        lines.append("skipped: " + ", ".join(f"{n} {r}" for r, n in report["skipped_by_reason"].items()))
        for s in report["skipped"][:limit]:
            lines.append(f"  {s['detail']}")
        if len(report["skipped"]) > limit:
            lines.append(f"  ... {len(report['skipped']) - limit} more in the report")
    if report.get("status") == "stopped":
        return "\n".join(lines)
    tok = report["tokens"]
    if tok:
        lines.append("tokens: " + ", ".join(f"{k} {v:,}" for k, v in tok.items()))
    if report["media"]:
        lines.append("media: " + ", ".join(f"{v:,} {k}" for k, v in report["media"].items()))
    if report.get("layout_note"):
        lines.append(f"note: {report['layout_note']}")
    r = report["run"]
    util = r.get("encoder_utilisation")
    lines.append(f"time: plan {r['plan_s']:.1f} s, encode {r['encode_s']:.1f} s ({r['items_per_s']:.1f} items/s"
                 + (f", encoders busy {util:.0%} of the time" if util is not None else "")
                 + f"), merge {r['merge_s']:.1f} s; {r['batches']} batches, {r['batches_resumed']} resumed from a "
                 "previous run")
    if r.get("media_cache"):
        mc = r["media_cache"]
        lines.append(f"media cache: {mc['hits']:,} items from the cache, {mc['misses']:,} encoded")
    return "\n".join(lines)


def _outputs_intact(cfg: TokenizeConfig) -> bool:
    from apertus_plugins.data.manifest import ManifestError, verify_manifest

    try:
        for path, streams in cfg.manifests().items():
            if storage.is_local(path):
                wanted = [cfg.prefix(s) for s in streams] if cfg.merge == "single" else None
                verify_manifest(storage.local_path(path), wanted, checksums=False)
                continue
            if not storage.isfile(path):
                return False
            manifest = json.loads(storage.read_bytes(path))
            for e in manifest["datasets"]:
                if (storage.stamp(f"{e['prefix']}.bin")[0], storage.stamp(f"{e['prefix']}.idx")[0]) != \
                        (e["bin_bytes"], e["idx_bytes"]):
                    return False
    except (ManifestError, OSError, ValueError, KeyError):
        return False
    return True


def _complete(cfg: TokenizeConfig) -> dict[str, Any] | None:
    """The report of an earlier run with the same settings and inputs whose outputs are all intact."""
    if not storage.isfile(cfg.report_path):
        return None
    try:
        report = storage.read_json(cfg.report_path)
    except (OSError, ValueError):
        return None
    if report.get("format") != REPORT_FORMAT or report.get("version") != REPORT_VERSION or \
            diff(report.get("fingerprint"), cfg.fingerprint()):
        if any(storage.exists(f"{cfg.prefix(s)}.bin") for s in cfg.streams()) and not cfg.restart:
            raise RunError(f"{cfg.out}: exists from a run with other settings or inputs; pass --restart to "
                           "replace it")
        return None
    if report.get("status", "complete") != "complete":  # a run stopped on --max-bad-fraction: not done
        return None
    inputs = report.get("inputs", {})
    digest = hashlib.sha256()
    for line in listing_lines(cfg):
        digest.update(line)
    changed = digest.hexdigest() != inputs.get("listing_sha256") or \
        any(storage.stamp(path) != old for path, *old in inputs.get("referenced", []))
    if changed:
        if not cfg.restart:
            raise RunError(f"{cfg.out}: its inputs changed since it was written; pass --restart to redo it")
        return None
    return report if _outputs_intact(cfg) else None


def _clear(work: str) -> None:
    """Everything of an earlier run in the work directory but the lock (under the lock)."""
    for name in storage.listdir(work):
        if name != "lock":
            storage.remove(storage.join(work, name), recursive=True)


def tokenize(cfg: TokenizeConfig, out: Any = None) -> dict[str, Any]:
    """Run (or resume) the offline pipeline; print the summary to ``out`` and return the report."""
    from apertus_plugins.plugins import spec_from_tokenizer_dir

    out = out or sys.stdout
    _memory_check(cfg)
    layout = Layout(cfg.work)
    done = None if cfg.restart else _complete(cfg)
    if done is not None:
        if not cfg.keep_work:
            storage.remove(cfg.work, recursive=True)
        print(f"{cfg.out}: already complete (same settings and inputs, outputs match their manifests)", file=out)
        print(format_report(done), file=out)
        return done
    spec = spec_from_tokenizer_dir(cfg.tokenizer)
    with _lock(cfg.work):
        if cfg.restart:  # under the lock: never pull the work directory from under a running run
            _clear(cfg.work)
        ex = make_executor(cfg.workers, cfg.ray_address, cfg.encoders)
        try:
            device = ex.device(cfg.device) if cfg.checkpoint else cfg.device
            if cfg.precision == "tf32" and not device.startswith("cuda"):
                raise RunError(f"--precision tf32 needs a CUDA device; --device {cfg.device} gives {device}")
            storage.write_json(layout.config, asdict(replace(cfg, device=device)))
            plan, plan_info = Planner(cfg, layout, ex).run()
            if cfg.plan_only:
                return _plan_summary(cfg, layout, plan, plan_info, out)
            try:
                enc = _encode(cfg, layout, plan, ex)
            except StopRun as stop:
                report = _stopped(cfg, layout, plan, stop.why)
                print(format_report(report), file=out)
                raise RunError(f"{stop.why}: above --max-bad-fraction {cfg.max_bad_fraction:g}, so the run stopped "
                               f"(the report {cfg.report_path} names every skipped item). Finished work is kept: run "
                               "again with a higher --max-bad-fraction to continue, or fix the inputs and pass "
                               "--restart") from None
            t1 = time.perf_counter()
            merged = _merge_parts(cfg, layout, plan, ex)
        finally:
            ex.close()
        parts = merged["parts"]
        _check_layout(cfg, parts)
        remote = _concat(cfg, layout, parts) if cfg.merge == "single" else {}
        merge_s = time.perf_counter() - t1
        _manifests(cfg, spec, parts, remote)
        stats = enc["progress"]
        timing = {
            "plan_s": round(plan_info.plan_s, 3), "encode_s": round(enc["encode_s"], 3), "merge_s": round(merge_s, 3),
            "items_per_s": stats["items_per_s"],
            "batches": plan.batches, "batches_resumed": enc["batches_resumed"],
            "plan_resumed": plan_info.plan_resumed, "shards": plan.shards,
            "shards_resumed": plan_info.shards_resumed, "parts_resumed": merged["parts_resumed"],
            "scan_items_per_s": plan_info.scan_items_per_s,
            "workers": 0 if cfg.ray_address else cfg.workers, "ray_address": cfg.ray_address,
            "encoders": ex.encoders, "device": enc["devices"][0] if len(enc["devices"]) == 1 else enc["devices"],
            "encoder_utilisation": stats["encoder_utilisation"],
            "encoder_share_of_stage": stats["encoder_share_of_stage"],
            "encoder_share_of_batch_time": stats["encoder_share_of_batch_time"], "merge": cfg.merge,
            "media_cache": stats.get("media_cache"),
            "peak_rss_mb": {"driver": peak_rss_mb(), "planning": plan_info.peak_rss_mb,
                            "decoding": enc["peak_rss_mb"]["decode"], "encoding": enc["peak_rss_mb"]["encode"],
                            "merging": max([p["peak_rss_mb"] for p in parts], default=0.0)},
            "progress": stats,
        }
        report = _report(cfg, layout, plan, parts, spec, timing)
        storage.write_json(cfg.report_path, report)
    if not cfg.keep_work:
        storage.remove(cfg.work, recursive=True)
    print(format_report(report), file=out)
    return report
