"""The pipeline on a real Ray cluster: planning tasks, decode tasks, encoder actors, write and merge tasks.

The tests start a Ray head on loopback with two CPUs, so two worker processes run the tasks
(``ray start --head --block`` in its own process group, stopped by signalling that group only),
and run ``apertus tokenize ... --ray-address`` against it from separate driver processes. The
input mixes images and clips in a folder, two WebDataset shards and a JSONL file of
conversations; the folder is cut into planning shards of four files and the JSONL into 2 KB
ranges, so several tasks plan it. Every output is compared byte for byte with the same input run
in one process (``--workers 0``, one planning shard per folder or file: the pipeline as it ran
before it was distributed).

* the plan is made by several tasks, the encoder actor uses the CPU (``--device auto``), loads
  each encoder once, and every task read only its slice: a planning task its shard's files, a
  batching task the item files of its windows, a batch its own line of the plan and its own media
  (from the records and summaries each task writes);
* a run killed at a planning point, an encoding point and a merge point (SIGKILL of the driver,
  from inside a Ray task) resumes, reusing the finished work, to the same bytes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _offline_data import SFT_SUFFIXES, cli, outputs, records, workspace

from apertus_plugins.data.offline.sources import shard_files

FAULT = "APERTUS_TOKENIZE_FAULT"
# Ray 2.60 turns on token authentication for a head as soon as ~/.ray/auth_token exists (any local
# ray.init() on the machine writes it); the head, ``ray status`` and the drivers run without it here
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
#: the Ray runs: small planning shards; a small window spreads the batches over several plan parts
PRETRAIN = ["--window", "6", "--plan-files", "4"]
SFT = ["--plan-bytes", "2KB"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
         "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--object-store-memory",
         str(200 * 2**20), "--temp-dir", temp],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    address = f"127.0.0.1:{port}"

    def stop() -> None:  # the head's children (GCS, raylet, workers) share its process group: stop that group only
        try:
            os.killpg(head.pid, signal.SIGTERM)
            time.sleep(3)
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=60)

    try:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run([ray, "status", "--address", address], capture_output=True, text=True, timeout=60)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                stop()  # before reading its output: a head started with --block never ends it
                raise AssertionError(f"the Ray head did not start:\n{head.stdout.read() if head.stdout else ''}\n"
                                     f"{probe.stdout}{probe.stderr}")
            time.sleep(1)
        yield address
    finally:
        stop()
        shutil.rmtree(temp, ignore_errors=True)


def _pretrain_args(out: Path, *extra: str) -> list[str]:
    ws = workspace()
    args = ws.pretrain_args(out, "--window", "6", *extra)
    return args[:3] + [str(ws.shard2)] + args[3:]  # folder, shard, shard2


@functools.cache
def single_process(kind: str) -> Path:
    """The input run in this one process with one planning shard per folder or file."""
    ws = workspace()
    out = ws.root / f"single-{kind}" / kind
    args = _pretrain_args(out, "--workers", "0") if kind == "pretrain" else ws.sft_args(out, "--workers", "0")
    res = cli(args)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pretrain_on_ray_is_planned_by_several_tasks_and_byte_identical(tmp_path: Path, ray_cluster: str) -> None:
    ref = single_process("pretrain")
    out = tmp_path / "ray" / "pretrain"
    res = cli(_pretrain_args(out, *PRETRAIN, "--ray-address", ray_cluster, "--device", "auto", "--keep-work"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(ref)
    report = json.loads(Path(f"{out}.report.json").read_text())
    single = json.loads(Path(f"{ref}.report.json").read_text())
    for key in ("items", "skipped_by_reason", "tokens", "media"):
        assert report[key] == single[key], key
    run = report["run"]
    assert run["ray_address"] == ray_cluster and run["device"] == "cpu" and run["encoders"] == 1
    assert run["shards"] >= 5 and single["run"]["shards"] == 3  # the folder in shards of 4 files; two tars
    assert 0 < run["encoder_utilisation"] <= 1 and run["progress"]["items_done"] == run["progress"]["items_total"]

    work = Path(f"{out}.work")
    specs = _lines(work / "plan" / "shards.jsonl")
    plan = json.loads((work / "plan.json").read_text())
    assert sum(1 for _n, batches, _i in plan["parts"] if batches) >= 3  # windows start in several parts
    # planning tasks read their own shard's files, nothing else
    counts = []
    for s, spec in enumerate(specs):
        summary = json.loads((work / "plan" / "scan" / f"s{s:06d}.json").read_text())
        assert summary["read"] and set(summary["read"]) <= set(shard_files(spec)), s
        counts.append(summary["items"])
    starts = [sum(counts[:s]) for s in range(len(counts) + 1)]
    # a batching task reads the item files of the shards its windows cover
    for p, (_first, _n, _items) in enumerate(plan["parts"]):
        summary = json.loads((work / "plan" / "batches" / f"p{p:06d}.json").read_text())
        lo = -(-starts[p] // 6) * 6
        if lo >= starts[p + 1]:
            assert summary["batches"] == 0 and summary["read"] == []
            continue
        hi = min((starts[p + 1] - 1) // 6 * 6 + 6, starts[-1])
        want = [str(work / "plan" / "scan" / f"s{s:06d}.jsonl") for s in range(len(counts))
                if counts[s] and starts[s] < hi and starts[s + 1] > lo]
        assert summary["read"] == want, p
    # a batch reads its own line of the plan and its own media; one encoder actor, each encoder loaded once
    encoders = set()
    for p, (first, n, _items) in enumerate(plan["parts"]):
        part_file = work / "plan" / "batches" / f"p{p:06d}.jsonl"
        lines = json.loads((work / "plan" / "batches" / f"p{p:06d}.json").read_text())["lines"]
        data = part_file.read_bytes()
        for k in range(n):
            rec = json.loads((work / "records" / f"p{p:06d}" / f"b{first + k:07d}.json").read_text())
            off, length, _count = lines[k]
            assert rec["read"]["plan"] == [str(part_file), off, length]
            batch = json.loads(data[off : off + length])
            assert rec["read"]["media"] == [[m["path"], m["offset"], m["size"]] for it in batch["items"]
                                            for m in it["media"]]
            if rec["encoder"]:  # (a batch whose items all failed to decode has nothing to encode)
                assert rec["device"] == "cpu"
                encoders.add(rec["encoder"]["pid"])
                assert rec["worker"]["pid"] != rec["encoder"]["pid"]  # decoded and written by tasks, encoded by the actor
    assert len(encoders) == 1


def test_sft_on_ray_in_byte_ranges_is_byte_identical(tmp_path: Path, ray_cluster: str) -> None:
    ws = workspace()
    ref = single_process("sft")
    out = tmp_path / "ray" / "sft"
    res = cli(ws.sft_args(out, *SFT, "--ray-address", ray_cluster))
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out, SFT_SUFFIXES) == outputs(ref, SFT_SUFFIXES)
    report = json.loads(Path(f"{out}.report.json").read_text())
    single = json.loads(Path(f"{ref}.report.json").read_text())
    assert report["run"]["shards"] > 3 and single["run"]["shards"] == 1
    # the skipped conversations keep their file:line names across the ranges
    assert [(s["source"], s["reason"]) for s in report["skipped"]] == \
        [(s["source"], s["reason"]) for s in single["skipped"]]


def test_kill_and_resume_on_ray_at_planning_encoding_and_merge_points(tmp_path: Path, ray_cluster: str) -> None:
    ref = single_process("pretrain")
    out = tmp_path / "run" / "pretrain"
    work = Path(f"{out}.work")
    args = _pretrain_args(out, *PRETRAIN, "--ray-address", ray_cluster)

    # 1. planning: killed right after shard 2 is planned
    res = cli(args, {FAULT: "plan-done:2"})
    assert res.returncode == -9, res.stdout + res.stderr
    assert (work / "plan" / "listing.json").is_file() and not (work / "plan.json").exists()
    planned = {p.name: p.stat().st_mtime_ns for p in (work / "plan" / "scan").glob("s*.json")}
    assert "s000002.json" in planned

    # 2. encoding: killed inside batch 3, after part of its shard is on disk, before its record
    res = cli(args, {FAULT: "batch-mid:3"})
    assert res.returncode == -9, res.stdout + res.stderr
    for name, mtime in planned.items():  # the shards planned before were not planned again
        assert (work / "plan" / "scan" / name).stat().st_mtime_ns == mtime, name
    plan = json.loads((work / "plan.json").read_text())
    assert 3 not in records(work) and list((work / "shards").rglob("b0000003.bin.tmp*"))

    # 3. merge: killed right after the second part with batches is merged
    part = [p for p, (_f, n, _i) in enumerate(plan["parts"]) if n][1]
    res = cli(args, {FAULT: f"merge-part:{part}"})
    assert res.returncode == -9, res.stdout + res.stderr
    assert records(work) == set(range(plan["batches"]))
    assert (work / "merged" / f"p{part:06d}.json").is_file() and not Path(f"{out}.bin").exists()

    # 4. the last run completes, reusing what was done
    res = cli(args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(ref)
    run = json.loads(Path(f"{out}.report.json").read_text())["run"]
    assert run["plan_resumed"] and run["batches_resumed"] == plan["batches"] and run["parts_resumed"] >= 1
    assert not work.exists()
