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
  from inside a Ray task) resumes, reusing the finished work, to the same bytes;
* a clip with NaN samples costs only itself on Ray as in one process (pretraining on the test head,
  SFT on a head of the run's own), and the driver killed alone (SIGKILL of its pid, not its group)
  takes the run's encoder actor with it, and the run's own head (``--ray-address local``) whole;
  the reruns resume to the same bytes;
* Ray on loopback: every process of the test head and of a run's own head listens on 127.0.0.1
  only (from their listening sockets), and both require a token.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from _offline_data import SFT_SUFFIXES, cli, outputs, records, start_cli, workspace

from apertus_plugins.data.offline.sources import shard_files
from apertus_plugins.testing.serve import free_port, kill_group

FAULT = "APERTUS_TOKENIZE_FAULT"
#: the test head: Ray's single-machine mode, in which a head started with --node-ip-address 127.0.0.1
#: keeps that address and its servers listen on it only, and a token of its own (the head, ``ray
#: status`` and the drivers get both through the environment; apertus_plugins.data.offline.rayhead)
SECURE = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
#: the Ray runs: small planning shards; a small window spreads the batches over several plan parts
PRETRAIN = ["--window", "6", "--plan-files", "4"]
SFT = ["--plan-bytes", "2KB"]


class Head(str):
    """The test head's address, with the pid of its ``ray start`` process."""

    pid: int


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Head]:
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    ray = str(Path(sys.executable).parent / "ray")
    saved = {k: os.environ.get(k) for k in SECURE}
    os.environ.update(zip(SECURE, ("0", "token", secrets.token_hex(32)), strict=True))
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
         "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--object-store-memory",
         str(200 * 2**20), "--temp-dir", temp],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    address = Head(f"127.0.0.1:{port}")
    address.pid = head.pid

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
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


# ---------------------------------------------------------------------- faults, orphans, loopback
def _loopback(ip: str) -> bool:
    return ip == "::1" or ip.startswith(("127.", "::ffff:127."))


def _listening(procs: list[psutil.Process], seen: dict[int, list]) -> None:
    """Add each process's name and listening addresses to ``seen`` (pid -> [name, {ip:port}])."""
    for p in procs:
        try:
            name = p.name()
            addrs = {f"{c.laddr.ip}:{c.laddr.port}" for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
        entry = seen.setdefault(p.pid, [name, set()])
        entry[0] = name if name.startswith("ray::") or not entry[0].startswith("ray::") else entry[0]
        entry[1] |= addrs


def _check_loopback(seen: dict[int, list]) -> None:
    names = {n for n, _a in seen.values()}
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), names
    for name in ("gcs_server", "raylet"):
        assert any(a for n, a in seen.values() if n == name), name  # they were seen listening
    wide = {f"{n} ({pid})": sorted(a) for pid, (n, a) in seen.items() if any(not _loopback(x.rsplit(":", 1)[0]) for x in a)}
    assert not wide, f"listening beyond loopback: {wide}"


def _watch(proc: subprocess.Popen[str], until: object = None, timeout: float = 900) -> dict[int, list]:
    """Every process of a driver's tree and its listening sockets, until it exits (or ``until(seen)``)."""
    seen: dict[int, list] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            driver = psutil.Process(proc.pid)
            _listening([driver, *driver.children(recursive=True)], seen)
        except psutil.Error:
            pass
        if until is not None and until(seen):
            break
        time.sleep(0.2)
    return seen


def _actor(seen: dict[int, list]) -> int | None:
    return next((pid for pid, (n, _a) in seen.items() if n.startswith("ray::EncoderActor")), None)


def _gone(pids: list[int], timeout: float) -> list[str]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _gone_, alive = psutil.wait_procs(procs, timeout=timeout)
    return [f"{p.pid} {p.name()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@functools.cache
def faulty_single(kind: str) -> Path:
    """The inputs with a NaN clip (_offline_data.write_faulty_inputs) in one process."""
    ws = workspace()
    out = ws.root / f"faulty-single-{kind}" / kind
    src = ws.faulty["media" if kind == "pretrain" else "conversations"]
    res = cli([kind, str(src), "--out", str(out), "--tokenizer", str(ws.tokenizer), "--checkpoint", str(ws.checkpoint),
               "--workers", "0", "--no-progress", *(["--mask-stream"] if kind == "sft" else [])])
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _skips(prefix: Path) -> list[tuple[str, str]]:
    return [(Path(s["source"]).name, s["reason"]) for s in json.loads(Path(f"{prefix}.report.json").read_text())["skipped"]]


def test_the_test_head_listens_on_loopback_only(ray_cluster: Head) -> None:
    head = psutil.Process(ray_cluster.pid)
    seen: dict[int, list] = {}
    deadline = time.monotonic() + 120
    while True:  # the raylet and its agents may still be starting when the GCS answers
        _listening([head, *head.children(recursive=True)], seen)
        names = {n for n, a in seen.values() if a or n.startswith("ray::")}
        if {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names):
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.5)
    _check_loopback(seen)


def test_a_nan_clip_on_ray_and_the_encoder_actor_ends_with_its_driver(tmp_path: Path, ray_cluster: Head) -> None:
    ws = workspace()
    ref = faulty_single("pretrain")
    out = tmp_path / "ray" / "pretrain"
    args = ["pretrain", str(ws.faulty["media"]), "--out", str(out), "--tokenizer", str(ws.tokenizer), "--checkpoint",
            str(ws.checkpoint), "--ray-address", ray_cluster, "--no-progress"]
    proc = start_cli(args)
    try:
        head = psutil.Process(ray_cluster.pid)
        deadline = time.monotonic() + 600
        actor = None
        while actor is None:  # the run's encoder actor, a process of the head's
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no encoder actor"
            seen: dict[int, list] = {}
            _listening(head.children(recursive=True), seen)
            actor = _actor(seen)
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone
        proc.wait(timeout=60)
        assert not _gone([actor], timeout=90), "the encoder actor outlived its driver"
    finally:
        kill_group(proc)
    res = cli(args)  # the rerun resumes what the killed one finished
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(ref)
    assert _skips(out) == _skips(ref) and _skips(out)[0][0] == "nan.wav"


def test_a_run_of_its_own_head_is_loopback_only_and_gone_with_its_driver(tmp_path: Path) -> None:
    """``--ray-address local``: SFT with the NaN clip; the driver killed alone once the actor runs, then a rerun."""
    ws = workspace()
    ref = faulty_single("sft")
    out = tmp_path / "local" / "sft"
    args = ["sft", str(ws.faulty["conversations"]), "--out", str(out), "--tokenizer", str(ws.tokenizer),
            "--checkpoint", str(ws.checkpoint), "--mask-stream", "--ray-address", "local", "--no-progress"]
    proc = start_cli(args)  # (the test head's variables are replaced by the run's own head's)
    try:
        seen = _watch(proc, until=lambda s: _actor(s) is not None)
        assert _actor(seen) is not None and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        _check_loopback(seen)
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone: its head's guard ends the head's session
        proc.wait(timeout=60)
        assert not _gone(list(seen), timeout=60), "processes of the run's Ray head outlived its driver"
    finally:
        kill_group(proc)
    proc = start_cli(args)
    try:
        seen = _watch(proc)
        assert proc.wait(timeout=900) == 0, proc.stdout.read() if proc.stdout else ""
    finally:
        kill_group(proc)
    _check_loopback(seen)
    assert not _gone(list(seen), timeout=60), "processes of the run's Ray head outlived the run"
    assert outputs(out, ("", ".mask")) == outputs(ref, ("", ".mask"))
    assert _skips(out) == _skips(ref) and _skips(out)[0][0] == "conv.jsonl:2"
