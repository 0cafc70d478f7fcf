"""The driver: plan (or resume), run the batches on local processes or Ray, merge, manifest, report.

Layout on disk for ``--out OUT``::

    OUT.bin, OUT.idx                 the merged dataset (int32 ids, one sequence per document)
    OUT.manifest.json                the core's manifest of OUT, with how it was made under "metadata"
    OUT.mask.bin/.idx                sft, --mask-stream: the token-aligned loss mask (uint8), in OUT's manifest
    OUT.noreason.bin/.idx            sft, --without-reasoning: the copy without reasoning spans
    OUT.noreason.mask.bin/.idx       both of the above
    OUT.noreason.manifest.json       the copy's manifest (with its mask stream)
    OUT.report.json                  the summary report (items written, skipped with reasons, tokens)
    OUT.work/                        while running (removed after success unless --keep-work):
        lock                         held by the running driver (flock)
        config.json                  the run's settings, read by every worker
        plan.json                    the deterministic plan: fingerprint, batches (written last, reused on resume)
        batches.jsonl, inputs.json   each batch's items (a worker reads its own line); the input files' stats
        shards/NNNN/bNNNNNNN*.bin/.idx   one Megatron indexed dataset per batch and stream
        records/bNNNNNNN.json        a batch's checkpoint: written last, after its shards

A run killed at any point is resumed by running the same command again: the plan is read back
(after checking that settings and inputs are unchanged), finished batches are kept, the others
are redone, and the merge starts over. The merged bytes depend only on the plan, so they equal
those of an uninterrupted run with any worker count, local or on Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .config import TokenizeConfig
from .plan import Plan, load_json, make_batches, save_json
from .sources import input_listing, scan_pretrain, scan_sft
from .worker import PGID_ENV, fault_point, record_path, run_batch, shard_prefix

__all__ = ["REPORT_FORMAT", "RunError", "tokenize", "format_report"]

REPORT_FORMAT = "apertus-tokenize-report"


class RunError(ValueError):
    """A run that cannot start or continue (another run holds the work dir, changed inputs...)."""


def _tqdm(progress: bool, **kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(disable=not progress, dynamic_ncols=True, file=sys.stderr, **kw)


@contextlib.contextmanager
def _lock(work: Path) -> Iterator[None]:
    work.mkdir(parents=True, exist_ok=True)
    fh = open(work / "lock", "a+")  # noqa: SIM115 (closed below)
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"{work}: another apertus tokenize run is using this work directory") from None
        yield
    finally:
        fh.close()


# ---------------------------------------------------------------------- planning
def _scan(cfg: TokenizeConfig) -> Plan:
    with _tqdm(cfg.progress, desc="plan", unit=" file" if cfg.kind == "pretrain" else " line") as bar:
        if cfg.kind == "pretrain":
            items, skips, files = scan_pretrain(cfg.sources, cfg.resize_policy, cfg.audio_policy, bar.update)
        else:
            items, skips, files = scan_sft(cfg.sources, cfg.media_root, cfg.resize_policy, cfg.audio_policy, bar.update)
    if cfg.checkpoint is None and any(it.media for it in items):
        kinds = sorted({m.kind for it in items for m in it.media})
        raise RunError(f"the inputs hold {' and '.join(kinds)} items: pass --checkpoint DIR (the media encoders)")
    batches = make_batches(items, cfg.kind, cfg.batch_size, cfg.batch_codes, cfg.window)
    plan = Plan(cfg.fingerprint(), input_listing(files), skips, batches, len(items))
    plan.save(cfg.work, items)
    return plan


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [path]


def _check_unchanged(plan: Plan, cfg: TokenizeConfig, where: str) -> None:
    keys = _diff(plan.fingerprint, cfg.fingerprint())
    if keys:
        raise RunError(f"{where} was made with other settings ({', '.join(keys[:6])} differ); run with the same "
                       "settings to resume it, or pass --restart to discard it")
    now = input_listing([f for f, _s, _m in plan.inputs])
    changed = [f for (f, *old), (_f, *new) in zip(plan.inputs, now, strict=True) if old != new]
    if changed:
        raise RunError(f"{len(changed)} input file(s) changed since {where} was made (e.g. {changed[0]}); "
                       "pass --restart to plan again")


def _load_or_plan(cfg: TokenizeConfig) -> tuple[Plan, bool, float]:
    work = cfg.work
    t0 = time.perf_counter()
    plan_file = work / "plan.json"
    if plan_file.is_file():
        plan = Plan.load(work)
        _check_unchanged(plan, cfg, str(plan_file))
        return plan, True, time.perf_counter() - t0
    for sub in ("shards", "records"):  # leftovers without a plan cannot be trusted
        shutil.rmtree(work / sub, ignore_errors=True)
    return _scan(cfg), False, time.perf_counter() - t0


# ---------------------------------------------------------------------- execution
def _execute(cfg: TokenizeConfig, todo: list[int], on_done: Callable[[dict[str, Any]], None]) -> None:
    work = str(cfg.work)
    if not todo:
        return
    if cfg.ray_address:
        _execute_ray(cfg, work, todo, on_done)
    elif cfg.workers == 0:
        for b in todo:
            on_done(run_batch(work, b))
    else:
        _execute_local(cfg, work, todo, on_done)


def _init_worker(pgid: int, threads: int) -> None:
    """A local worker process: the run's process group (for the fault hook) and its share of the CPUs."""
    os.environ[PGID_ENV] = str(pgid)
    os.environ["APERTUS_TOKENIZE_THREADS"] = str(threads)


def _execute_local(cfg: TokenizeConfig, work: str, todo: list[int], on_done: Callable[[dict[str, Any]], None]) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    n = min(cfg.workers, len(todo))
    threads = max(1, (os.cpu_count() or 1) // n)
    # spawn: the driver may have imported torch (megatron-core's builder); forking it is unsafe
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(os.getpgrp(), threads)) as ex:
        futures = {ex.submit(run_batch, work, b): b for b in todo}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                exc = f.exception()
                if exc is not None:
                    for p in pending:
                        p.cancel()
                    raise RunError(f"batch {futures[f]} failed: {type(exc).__name__}: {exc} (finished batches are "
                                   "kept; run the same command again to resume)") from exc
                on_done(f.result())


def _execute_ray(cfg: TokenizeConfig, work: str, todo: list[int], on_done: Callable[[dict[str, Any]], None]) -> None:
    """Each batch is a Ray task; Ray schedules them over the cluster's CPUs (or GPUs with --device cuda)."""
    import ray

    ray.init(address=cfg.ray_address, log_to_driver=False, ignore_reinit_error=True)
    try:
        resources = {"num_gpus": 1} if cfg.device.startswith("cuda") else {"num_cpus": 1}
        task = ray.remote(max_retries=2, **resources)(run_batch)
        cap = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        queue = list(todo)
        pending: dict[Any, int] = {}
        while queue or pending:
            while queue and len(pending) < cap:
                b = queue.pop(0)
                pending[task.remote(work, b)] = b
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            b = pending.pop(ref)
            try:
                on_done(ray.get(ref))
            except Exception as exc:
                raise RunError(f"batch {b} failed on the Ray cluster: {exc} (finished batches are kept; run the "
                               "same command again to resume)") from exc
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------- merge
def _megatron_builder() -> Any:
    import warnings

    with warnings.catch_warnings():  # megatron-core warns about optional fused kernels on import
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder


def _merge(cfg: TokenizeConfig, plan: Plan, records: dict[int, dict[str, Any]]) -> None:
    """Every stream's batch shards, in plan order, into one dataset written by megatron-core's builder."""
    import torch

    from ..indexed import IndexedDataset

    IndexedDatasetBuilder = _megatron_builder()  # noqa: N806

    work = cfg.work
    docs = sum(r["documents"] for r in records.values())
    streams = cfg.streams()
    with _tqdm(cfg.progress, desc="merge", unit=" doc", total=docs * len(streams)) as bar:
        for n, stream in enumerate(streams):
            final = cfg.prefix(stream)
            tmp = f"{final}.tmp"
            Path(final).parent.mkdir(parents=True, exist_ok=True)
            builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.dtype(stream.dtype).type)
            appended = 0
            for b in plan.batches:
                if not records[b.id]["documents"]:
                    continue
                shard = IndexedDataset(shard_prefix(work, b.id, stream.suffix))
                if shard.num_documents != records[b.id]["documents"]:
                    raise RunError(f"{shard.prefix}: {shard.num_documents} documents, its record says "
                                   f"{records[b.id]['documents']}")
                for d in range(shard.num_documents):
                    arr = np.array(shard.document(d))
                    builder.add_document(torch.from_numpy(arr), [int(arr.size)])
                bar.update(shard.num_documents)
                appended += 1
                if n == 0:
                    fault_point("merge-mid", appended)
            builder.finalize(f"{tmp}.idx")
            for ext in (".bin", ".idx"):
                with open(f"{tmp}{ext}", "rb") as fh:
                    os.fsync(fh.fileno())
            for ext in (".bin", ".idx"):
                os.replace(f"{tmp}{ext}", f"{final}{ext}")


def _check_layout(cfg: TokenizeConfig, spec: Any, limit: int = 64) -> str | None:
    """The image layout found in the first documents with images (a mixed or foreign layout raises)."""
    from ..indexed import IndexedDataset
    from ..media.image import dataset_image_layouts

    found = dataset_image_layouts(IndexedDataset(cfg.out), spec, limit=limit)
    if found - {cfg.image_layout}:
        raise RunError(f"{cfg.out}: documents use the {', '.join(sorted(found))} image layout, the run asked for "
                       f"{cfg.image_layout}")
    return found.pop() if found else None


def _metadata(cfg: TokenizeConfig, stream_suffix: str, spec: Any) -> dict[str, Any]:
    from ..plugins import serving_layout

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
        "audio_padding": "none (clips are batched only with clips of identical length; no codes dropped)",
        "tokenizer": fp["settings"]["tokenizer"],
        "tokenizer_sha256": fp["tokenizer_sha256"],
        "checkpoint": fp["settings"]["checkpoint"],
        "precision": cfg.precision,
        "vocab": {"total": spec.size, "modalities": spec.summary()["modalities"]},
    }
    if cfg.kind == "pretrain":
        meta.update(bos=cfg.bos, eos=cfg.eos, audio_task=cfg.audio_task, captions=cfg.captions)
    else:
        meta.update(chat_variant="training", reasoning="removed" if ".noreason" in stream_suffix else "kept")
    return meta


# ---------------------------------------------------------------------- report
def _report(cfg: TokenizeConfig, plan: Plan, records: dict[int, dict[str, Any]], spec: Any,
            timing: dict[str, Any]) -> dict[str, Any]:
    from ..plugins import serving_layout

    skipped = [asdict(s) for s in plan.skipped]
    for b in plan.batches:
        skipped.extend(records[b.id]["skipped"])
    written = sum(r["documents"] for r in records.values())
    names = spec.modality_names
    outputs: dict[str, Any] = {}
    for s in cfg.streams():
        entry: dict[str, Any] = {"documents": written, "dtype": s.dtype, "what": s.what}
        if s.dtype == "int32":
            tok = {n: sum(r["tokens"].get(s.suffix, {}).get(n, 0) for r in records.values()) for n in names}
            entry["tokens"] = dict(tok, total=sum(tok.values()))
        outputs[cfg.prefix(s)] = entry
    media = Counter()
    for r in records.values():
        media.update(r.get("media", {}))
    serving = serving_layout("image")
    note = None
    if media.get("image") and cfg.image_layout != serving:
        note = (f"images are in the {cfg.image_layout} layout; serving (the released processor) uses the {serving} "
                "layout (SPEC.md 2.1). The manifest records the layout; pass --image-layout "
                f"{serving} for data that matches serving.")
    return {
        "format": REPORT_FORMAT,
        "version": 1,
        "kind": cfg.kind,
        "outputs": outputs,
        "items": {"total": plan.total_items + len(plan.skipped), "written": written, "skipped": len(skipped)},
        "skipped_by_reason": dict(sorted(Counter(s["reason"] for s in skipped).items())),
        "skipped": skipped,
        "tokens": outputs[cfg.out].get("tokens", {}),
        "media": dict(sorted(media.items())),
        "image_layout": cfg.image_layout,
        "layout_note": note,
        "run": timing,
        "fingerprint": plan.fingerprint,
        "inputs": plan.inputs,
    }


def format_report(report: dict[str, Any], limit: int = 20) -> str:
    """The summary printed at the end of a run."""
    items = report["items"]
    lines = []
    for prefix, o in report["outputs"].items():
        tok = o.get("tokens", {})
        extra = f", {tok.get('total', 0):,} tokens" if tok else ""
        lines.append(f"wrote {prefix}.bin/.idx: {o['documents']:,} documents{extra} ({o['what']})")
    lines.append(f"items: {items['total']:,} in the inputs, {items['written']:,} written, {items['skipped']:,} skipped")
    if report["skipped_by_reason"]:
        lines.append("skipped: " + ", ".join(f"{n} {r}" for r, n in report["skipped_by_reason"].items()))
        for s in report["skipped"][:limit]:
            lines.append(f"  {s['detail']}")
        if len(report["skipped"]) > limit:
            lines.append(f"  ... {len(report['skipped']) - limit} more in the report")
    tok = report["tokens"]
    if tok:
        lines.append("tokens: " + ", ".join(f"{k} {v:,}" for k, v in tok.items()))
    if report["media"]:
        lines.append("media: " + ", ".join(f"{v:,} {k}" for k, v in report["media"].items()))
    if report.get("layout_note"):
        lines.append(f"note: {report['layout_note']}")
    r = report["run"]
    lines.append(f"time: plan {r['plan_s']:.1f} s, encode {r['encode_s']:.1f} s ({r['items_per_s']:.1f} items/s), "
                 f"merge {r['merge_s']:.1f} s; {r['batches']} batches, {r['batches_resumed']} resumed from a "
                 "previous run")
    return "\n".join(lines)


def _complete(cfg: TokenizeConfig) -> dict[str, Any] | None:
    """The report of an earlier run with the same settings and inputs whose outputs are all intact."""
    from ..manifest import ManifestError, verify_manifest

    if not cfg.report_path.is_file():
        return None
    try:
        report = load_json(cfg.report_path)
    except (OSError, ValueError):
        return None
    if report.get("format") != REPORT_FORMAT or _diff(report.get("fingerprint"), cfg.fingerprint()):
        if any(Path(f"{cfg.prefix(s)}.bin").exists() for s in cfg.streams()) and not cfg.restart:
            raise RunError(f"{cfg.out}: exists from a run with other settings or inputs; pass --restart to "
                           "replace it")
        return None
    inputs = report.get("inputs", [])
    if input_listing([f for f, _s, _m in inputs]) != inputs:
        if not cfg.restart:
            raise RunError(f"{cfg.out}: its inputs changed since it was written; pass --restart to redo it")
        return None
    try:
        for path, streams in cfg.manifests().items():
            verify_manifest(path, [cfg.prefix(s) for s in streams], checksums=False)
    except ManifestError:
        return None
    return report


def tokenize(cfg: TokenizeConfig, out: Any = None) -> dict[str, Any]:
    """Run (or resume) the offline pipeline; print the summary to ``out`` and return the report."""
    from ..chat import ChatTokenizer
    from ..manifest import write_manifest

    out = out or sys.stdout
    work = cfg.work
    done = None if cfg.restart else _complete(cfg)
    if done is not None:
        if not cfg.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        print(f"{cfg.out}: already complete (same settings and inputs, outputs match their manifests)", file=out)
        print(format_report(done), file=out)
        return done
    spec = ChatTokenizer(cfg.tokenizer).spec
    with _lock(work):
        if cfg.restart:  # under the lock: never pull the work directory from under a running run
            for entry in work.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif entry.name != "lock":
                    entry.unlink()
        save_json(work / "config.json", asdict(cfg))
        plan, resumed, plan_s = _load_or_plan(cfg)
        for stale in (work / "shards").rglob("*.tmp*") if (work / "shards").is_dir() else []:
            stale.unlink(missing_ok=True)
        records: dict[int, dict[str, Any]] = {}
        for b in plan.batches:
            f = record_path(work, b.id)
            if f.is_file():
                records[b.id] = load_json(f)
        todo = [b.id for b in plan.batches if b.id not in records]
        before = len(records)
        total = plan.planned_items
        t0 = time.perf_counter()
        new_items = 0
        with _tqdm(cfg.progress, desc="encode", unit=" item", total=total,
                   initial=sum(len(plan.batches[b].items) for b in records)) as bar:
            def on_done(rec: dict[str, Any]) -> None:
                nonlocal new_items
                records[rec["batch"]] = rec
                n = len(plan.batches[rec["batch"]].items)
                new_items += n
                bar.update(n)

            _execute(cfg, todo, on_done)
        encode_s = time.perf_counter() - t0
        _megatron_builder()  # imported before the merge is timed
        t1 = time.perf_counter()
        _merge(cfg, plan, records)
        merge_s = time.perf_counter() - t1
        _check_layout(cfg, spec)
        for path, streams in cfg.manifests().items():
            write_manifest([cfg.prefix(s) for s in streams], path,
                           metadata={cfg.prefix(s): _metadata(cfg, s.suffix, spec) for s in streams})
        timing = {
            "plan_s": round(plan_s, 3), "encode_s": round(encode_s, 3), "merge_s": round(merge_s, 3),
            "items_per_s": round(new_items / encode_s, 2) if encode_s > 0 and new_items else 0.0,
            "batches": len(plan.batches), "batches_resumed": before, "plan_resumed": resumed,
            "workers": 0 if cfg.ray_address else cfg.workers, "ray_address": cfg.ray_address,
        }
        report = _report(cfg, plan, records, spec, timing)
        save_json(cfg.report_path, report)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(format_report(report), file=out)
    return report
