"""Kill-and-resume: a run SIGKILLed at any point resumes to output byte-identical to an uninterrupted run.

Each run is ``apertus tokenize`` in a subprocess of its own session, with two local worker
processes. Kills are real SIGKILLs of the whole process group (driver and workers): one from
outside at an arbitrary moment (as soon as a batch checkpoint appears), and three at exact points
through the documented fault-injection hook ``APERTUS_TOKENIZE_FAULT``: inside a batch after part
of its shard is on disk, right after a batch's checkpoint (between batches), and in the middle of
the final merge. (Kills at planning points and at the merge of one plan part, on Ray: see the
Ray tests.) Each run resumes the state the previous one left. The final output is compared byte for
byte with the uninterrupted reference run (``.bin``, ``.idx`` and the manifest's sizes, counts and
checksums). A resumed run also refuses inputs that changed since the plan was made.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from _offline_data import (
    SFT_SUFFIXES,
    cli,
    outputs,
    planned_batches,
    records,
    reference,
    start_cli,
    workspace,
)

from apertus_plugins.testing.serve import kill_group

FAULT = "APERTUS_TOKENIZE_FAULT"
_records = records
_batches = planned_batches


def _same_report(a: Path, b: Path) -> None:
    ra, rb = (json.loads(Path(f"{p}.report.json").read_text()) for p in (a, b))
    for key in ("items", "skipped_by_reason", "tokens", "media", "image_layout"):
        assert ra[key] == rb[key], key
    assert [(s["reason"], Path(s["source"]).name) for s in ra["skipped"]] == \
        [(s["reason"], Path(s["source"]).name) for s in rb["skipped"]]


def test_kill_and_resume_pretrain_is_byte_identical(tmp_path: Path) -> None:
    ws = workspace()
    ref = reference("pretrain")
    out = tmp_path / "run" / "pretrain"
    work = Path(f"{out}.work")
    args = ws.pretrain_args(out, "--workers", "2")

    # 1. killed from outside as soon as the first batch checkpoint is on disk
    proc = start_cli(args)
    deadline = time.monotonic() + 300
    while not (work / "records").is_dir() or not _records(work):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "no batch finished in time"
        time.sleep(0.02)
    kill_group(proc)
    total = _batches(work)
    done = _records(work)
    assert 0 < len(done) < total and not Path(f"{out}.bin").exists()

    # 2. killed inside a batch, after part of its shard data was written, before its checkpoint
    k = min(set(range(total)) - done)
    res = cli(args, {FAULT: f"batch-mid:{k}"})
    assert res.returncode == -9, res.stderr
    assert k not in _records(work)
    assert list((work / "shards").rglob(f"b{k:07d}.bin.tmp*")), "the killed batch left no partial shard"
    done = _records(work)

    # 3. killed right after a batch's checkpoint, other batches in flight
    k2 = min(set(range(total)) - done)
    res = cli(args, {FAULT: f"batch-done:{k2}"})
    assert res.returncode == -9, res.stderr
    assert k2 in _records(work) and not Path(f"{out}.bin").exists()

    # 4. killed in the middle of the final merge (after the first plan part is appended), every batch done
    res = cli(args, {FAULT: "merge-mid:1"})
    assert res.returncode == -9, res.stderr
    assert _records(work) == set(range(total))
    assert not Path(f"{out}.bin").exists() and Path(f"{out}.tmp.bin").exists()

    # a changed input is refused by the resumed run
    victim = ws.folder / "img" / "00.jpg"
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        res = cli(args)
        assert res.returncode == 1 and "changed" in res.stderr and "--restart" in res.stderr
    finally:
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))

    # 5. the last run completes
    res = cli(args)
    assert res.returncode == 0, res.stderr
    assert outputs(out) == outputs(ref)
    _same_report(out, ref)
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["run"]["batches_resumed"] == total and report["run"]["plan_resumed"] is True
    assert not work.exists()


def test_kill_and_resume_sft_with_four_streams_is_byte_identical(tmp_path: Path) -> None:
    ws = workspace()
    ref = reference("sft")
    out = tmp_path / "run" / "sft"
    args = ws.sft_args(out, "--workers", "1")
    res = cli(args, {FAULT: "batch-done:0"})
    assert res.returncode == -9, res.stderr
    assert _records(Path(f"{out}.work")) == {0}
    assert not any(Path(f"{out}{s}.bin").exists() for s in SFT_SUFFIXES)
    res = cli(args)
    assert res.returncode == 0, res.stderr
    assert outputs(out, SFT_SUFFIXES) == outputs(ref, SFT_SUFFIXES)
    _same_report(out, ref)
