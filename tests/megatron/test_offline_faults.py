"""A bad item costs only itself; a mostly broken run stops with its report; a killed driver leaves no worker.

* A clip with NaN samples among clips of its exact length (one batch): the clip is skipped, named
  (file, or ``file:line`` of its conversation) with its reason in the report, above the progress
  bar and in ``progress.json``, counted; every other item of its batch is written, and the
  outputs are byte-identical to a run on the inputs without the clip (pretraining and SFT). With
  two workers, planned by ``--plan-only`` (exit 0), killed after that batch's checkpoint and
  resumed, the bytes are the same and the clip is not tried again. (On Ray: see the Ray tests.)
* The encoder on a batch holding a NaN clip: the batch is bisected, the other clips are encoded,
  their codes equal each clip encoded alone.
* ``--max-bad-fraction``: a run whose inputs are mostly broken stops after planning, or during
  encoding, with a report naming the skipped items and no output; the same command with a higher
  fraction resumes it.
* ``--merge parts`` writes the file for Megatron-LM's ``--data-args-path``: read by megatron-core's
  own ``get_blend_from_list``, the part prefixes in order, weighted by their tokens. (Megatron's
  training loop on it: the megatron-train suite.)
* The driver killed by SIGKILL alone (not its process group): its worker processes exit; the
  parent-death signal and the parent watch each end a helper on their own.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from _offline_data import cli, outputs, start_cli, workspace

from apertus_plugins.data.indexed import IndexedDataset
from apertus_plugins.data.offline import RunError, TokenizeConfig, tokenize
from apertus_plugins.testing.serve import kill_group

FAULT = "APERTUS_TOKENIZE_FAULT"
#: the NaN clip is found by the encoder (its batch bisected) or, where the core validates samples,
#: refused while decoding; either way the reason names the failure and the detail names the clip
NAN_REASONS = {"encoder failed", "unreadable audio"}  # sources.Reasons.ENCODER, .AUDIO (user-facing strings)


def _common(*extra: str) -> list[str]:
    ws = workspace()
    return ["--tokenizer", str(ws.tokenizer), "--checkpoint", str(ws.checkpoint), *extra]


def _in_process(kind: str, sources: list[str], out: Path, **kw: object) -> dict:
    ws = workspace()
    cfg = TokenizeConfig(kind, sources, out=str(out), tokenizer=str(ws.tokenizer), checkpoint=str(ws.checkpoint),
                         workers=0, progress=False, **kw)
    return tokenize(cfg, out=io.StringIO())


def _nan_skip(report: dict, source: str) -> dict:
    (skip,) = report["skipped"]
    assert skip["source"].endswith(source), skip
    assert skip["reason"] in NAN_REASONS and "nan.wav" in skip["detail"], skip
    assert "nan" in skip["detail"].lower() or "finite" in skip["detail"].lower(), skip
    assert report["skipped_by_reason"] == {skip["reason"]: 1}
    return skip


def _without(folder: Path, name: str, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    (dest / name).unlink()
    return dest


def test_a_nan_clip_costs_only_itself_with_workers_plan_only_and_resume(tmp_path: Path) -> None:
    ws = workspace()
    media = Path(ws.faulty["media"])
    # the reference: the same inputs without the NaN clip, in one process
    clean = tmp_path / "clean" / "pre"
    _in_process("pretrain", [str(_without(media, "nan.wav", tmp_path / "clean-media"))], clean)
    # one process, the progress view on: skipped, named (above the bar too), counted; the three other
    # clips of its batch are written, and the documents are the clean run's, byte for byte
    one = tmp_path / "one" / "pre"
    res = cli(["pretrain", str(media), "--out", str(one), *_common("--workers", "0")])
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(Path(f"{one}.report.json").read_text())
    _nan_skip(report, "nan.wav")
    assert report["items"] == {"total": 5, "written": 4, "skipped": 1} and report["media"] == {"audio": 3, "image": 1}
    assert any(ln.startswith("skipped (") and "nan.wav" in ln for ln in res.stderr.splitlines()), res.stderr[-3000:]
    assert outputs(one) == outputs(clean)

    # two workers: --plan-only exits 0, a kill right after the NaN clip's batch, a resume
    out = tmp_path / "two" / "pre"
    args = ["pretrain", str(media), "--out", str(out), *_common("--workers", "2", "--no-progress")]
    res = cli([*args, "--plan-only"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "planned 5 items" in res.stdout and not Path(f"{out}.bin").exists()
    plan = json.loads(Path(f"{out}.work", "plan.json").read_text())
    line = Path(f"{out}.work", "plan", "batches", "p000000.jsonl").read_text().splitlines()[0]
    assert [Path(it["name"]).name for it in json.loads(line)["items"]] == ["a.wav", "b.wav", "c.wav", "nan.wav"]
    res = cli(args, {FAULT: "batch-done:0"})
    assert res.returncode == -9, res.stdout + res.stderr
    record = Path(f"{out}.work", "records", "p000000", "b0000000.json")
    committed = json.loads(record.read_text())
    assert [Path(s["source"]).name for s in committed["skipped"]] == ["nan.wav"] and len(committed["items"]) == 3
    stamp = record.stat().st_mtime_ns
    # the resumed run: the skip comes from the batch's record; the clip is not tried again
    res = cli([*args, "--keep-work"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(clean)
    assert record.stat().st_mtime_ns == stamp
    report = json.loads(Path(f"{out}.report.json").read_text())
    _nan_skip(report, "nan.wav")
    assert report["run"]["plan_resumed"] and 1 <= report["run"]["batches_resumed"] <= plan["batches"]
    progress = json.loads(Path(f"{out}.work", "progress.json").read_text())  # the progress view's file
    assert progress["skipped_by_reason"] == report["skipped_by_reason"]
    assert [Path(s["source"]).name for s in progress["skipped_latest"]] == ["nan.wav"]


def test_a_nan_clip_costs_only_its_conversation(tmp_path: Path) -> None:
    ws = workspace()
    conv = Path(ws.faulty["conversations"])
    clean_jsonl = tmp_path / "clean.jsonl"
    lines = conv.read_text().splitlines(keepends=True)
    clean_jsonl.write_text("".join(lines[:1] + lines[2:]))
    shutil.copytree(conv.parent / "media", tmp_path / "media")  # the JSONL names media/...
    clean = tmp_path / "clean" / "sft"
    _in_process("sft", [str(clean_jsonl)], clean, mask_stream=True)
    out = tmp_path / "nan" / "sft"
    report = _in_process("sft", [str(conv)], out, mask_stream=True, batch_size=4)
    skip = _nan_skip(report, "conv.jsonl:2")
    assert skip["stage"] in ("encode", "decode")
    assert report["items"] == {"total": 4, "written": 3, "skipped": 1}
    assert outputs(out, ("", ".mask")) == outputs(clean, ("", ".mask"))


def test_the_encoder_is_bisected_around_a_failing_clip(tmp_path: Path) -> None:
    """Below the core's validation: the encoder itself raises on a batch holding a NaN clip."""
    from dataclasses import asdict

    from apertus_plugins.data.offline import storage
    from apertus_plugins.data.offline.plan import Layout
    from apertus_plugins.data.offline.worker import WorkerContext
    from apertus_plugins.encoders import encode_audio, load_audio_tokenizer

    ws = workspace()
    cfg = TokenizeConfig("pretrain", [str(ws.folder)], out=str(tmp_path / "o"), tokenizer=str(ws.tokenizer),
                         checkpoint=str(ws.checkpoint), workers=0, progress=False, device="cpu")
    storage.write_json(Layout(cfg.work).config, asdict(cfg))
    ctx = WorkerContext(cfg.work)
    rng = np.random.default_rng(0)
    clips = [(rng.standard_normal(6000) * 0.2).astype(np.float32) for _ in range(5)]
    clips[3][10:20] = np.nan
    got = ctx.encode({"audio": ([(i, 0) for i in range(5)], clips)})
    assert set(got["failed"]) == {"audio"} and list(got["failed"]["audio"]) == [3]
    assert "NaN" in got["failed"]["audio"][3]
    model = load_audio_tokenizer(ws.checkpoint)
    for i, c in enumerate(got["codes"]["audio"]):
        if i == 3:
            assert c is None
        else:
            assert np.array_equal(c, encode_audio(model, [clips[i]])[0]), i
    clean = ctx.encode({"audio": ([(i, 0) for i in (0, 1)], clips[:2])})
    assert clean["failed"] == {} and all(np.array_equal(a, b) for a, b in
                                         zip(clean["codes"]["audio"], got["codes"]["audio"][:2], strict=True))


def test_max_bad_fraction_stops_a_mostly_broken_run_with_its_report(tmp_path: Path) -> None:
    ws = workspace()
    src = tmp_path / "in"
    src.mkdir()
    shutil.copy(Path(ws.faulty["media"]) / "ok.png", src / "ok.png")
    for k in range(3):
        (src / f"empty{k}.png").write_bytes(b"")
    out = tmp_path / "out" / "pre"
    args = ["pretrain", str(src), "--out", str(out), *_common("--workers", "0", "--no-progress")]
    res = cli(args)  # 3 of 4 skipped while planning: above the default 0.5
    assert res.returncode == 1, res.stdout + res.stderr
    assert "3 of the 4 input items are skipped (75.0%)" in res.stderr and "--max-bad-fraction 0.5" in res.stderr
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["status"] == "stopped" and report["skipped_by_reason"] == {"empty file": 3}
    assert sorted(Path(s["source"]).name for s in report["skipped"]) == ["empty0.png", "empty1.png", "empty2.png"]
    assert "stopped: 3 of the 4" in res.stdout and not Path(f"{out}.bin").exists()
    res = cli([*args, "--max-bad-fraction", "0.8"])  # continues the stopped run
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["status"] == "complete" and report["items"]["written"] == 1 and report["run"]["plan_resumed"]

    # stopped while encoding: the NaN clip is 1 of 5 input items, above 0.1; what was found is named
    stopped = tmp_path / "enc" / "pre"
    with pytest.raises(RunError, match=r"1 of the 5 input items are skipped \(20.0%\).*--max-bad-fraction 0.1"):
        _in_process("pretrain", [str(ws.faulty["media"])], stopped, max_bad_fraction=0.1)
    report = json.loads(Path(f"{stopped}.report.json").read_text())
    assert report["status"] == "stopped" and [Path(s["source"]).name for s in report["skipped"]] == ["nan.wav"]
    assert report["items"]["not_processed"] == 1 and not Path(f"{stopped}.bin").exists()  # the image's batch


def test_bad_fraction_rule() -> None:
    from apertus_plugins.data.offline.run import BadFraction

    b = BadFraction(0.5, planned=10_000, plan_skipped=100)
    assert b.exceeded() is None
    b.add(999, 999)
    assert b.exceeded() is None  # fewer than 1,000 items encoded: no projection yet
    b.add(1, 1)
    assert "projected" in (b.exceeded() or "")  # all of the first 1,000 failed
    b = BadFraction(0.5, planned=10, plan_skipped=10)
    assert b.exceeded() is None  # 10 of 20: not above one half
    b.add(1, 0)
    assert b.exceeded() is None
    b.add(1, 1)
    assert "11 of the 20" in (b.exceeded() or "")  # certain, whatever the rest holds
    assert BadFraction(1.0, planned=0, plan_skipped=5).exceeded() is None  # 1: never stops
    assert BadFraction(0.0, planned=5, plan_skipped=1).exceeded()  # 0: the first skip stops


def test_merge_parts_writes_the_data_args_file(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.utils import get_blend_from_list

    ws = workspace()
    out = tmp_path / "parts" / "sft"
    res = cli(["sft", str(ws.faulty["conversations"]), "--out", str(out), "--merge", "parts", "--plan-bytes", "200",
               "--mask-stream", "--without-reasoning", *_common("--workers", "0", "--no-progress")])
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(Path(f"{out}.report.json").read_text())
    for base in ("", ".noreason"):
        path = Path(f"{out}{base}.data-args.txt")
        assert report["outputs"][f"{out}{base}"]["data_args"] == str(path)
        assert f"--data-args-path {path}" in res.stdout
        prefixes, weights = get_blend_from_list(path.read_text().split())  # how Megatron-LM reads the file
        manifest = json.loads(Path(f"{out}{base}.manifest.json").read_text())["datasets"]
        tokens = [e for e in manifest if not e["prefix"].endswith(".mask")]
        assert len(prefixes) >= 2 and prefixes == [e["prefix"] for e in tokens] == report["outputs"][f"{out}{base}"]["parts"]
        assert weights == [float(e["tokens"]) for e in tokens] == [float(IndexedDataset(p).num_tokens) for p in prefixes]
    with pytest.raises(ValueError, match="without spaces"):
        TokenizeConfig("sft", [str(ws.faulty["conversations"])], out=str(tmp_path / "a b"), tokenizer=str(ws.tokenizer),
                       merge="parts")


def _workers(driver: psutil.Process) -> list[psutil.Process]:
    return [c for c in driver.children() if "multiprocessing" in " ".join(c.cmdline())]


def test_workers_exit_when_the_driver_alone_is_killed(tmp_path: Path) -> None:
    ws = workspace()
    out = tmp_path / "orphans" / "pre"
    proc = start_cli(["pretrain", str(ws.faulty["media"]), "--out", str(out), *_common("--workers", "2", "--no-progress")])
    try:
        driver = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        while len(_workers(driver)) < 2 or not list(Path(f"{out}.work").glob("plan/scan/*.json")):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        children = driver.children(recursive=True)  # the workers (and multiprocessing's resource tracker)
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: its workers get no signal from us
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [(p.pid, p.cmdline()[-2:]) for p in alive]
    finally:
        kill_group(proc)


_HELPER = r"""
import os, subprocess, sys, time
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, __file__, "child", sys.argv[2], str(os.getpid()), sys.argv[3]])
    print(child.pid, flush=True)
    time.sleep(600)
else:
    sys.path.insert(0, os.environ["APERTUS_ROOT"])
    from apertus_plugins.data.offline.lifeline import exit_with_parent
    mode = sys.argv[2]
    exit_with_parent(int(sys.argv[3]), prctl=mode == "prctl", interval=1.0 if mode == "watch" else None)
    open(sys.argv[4], "w").close()
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["prctl", "watch"])
def test_each_lifeline_alone_ends_a_helper_whose_parent_is_killed(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "helper.py"
    script.write_text(_HELPER)
    root = str(Path(__file__).resolve().parents[2])
    armed = tmp_path / "armed"
    parent = subprocess.Popen([sys.executable, str(script), "parent", mode, str(armed)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "APERTUS_ROOT": root}, start_new_session=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 120
        while not armed.exists():  # the child armed its lifeline
            assert child.is_running() and time.monotonic() < deadline
            time.sleep(0.05)
        parent.kill()
        parent.wait(timeout=30)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, mode
    finally:
        kill_group(parent)


def test_an_item_that_kills_its_worker_costs_only_itself(tmp_path: Path) -> None:
    """A decoder that crashes on one file (the fault hook kills the process decoding c.wav, every time):
    the pool is started again, the batch runs item by item, c.wav is skipped after its second death."""
    ws = workspace()
    media = Path(ws.faulty["media"])
    src = _without(media, "nan.wav", tmp_path / "clean-media")
    (src / "c.wav").unlink()
    clean = tmp_path / "clean" / "pre"
    _in_process("pretrain", [str(src)], clean)
    out = tmp_path / "crash" / "pre"
    res = cli(["pretrain", str(media), "--out", str(out), *_common("--workers", "2", "--no-progress")],
              {FAULT: "crash-item:c.wav"})
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(Path(f"{out}.report.json").read_text())
    reasons = {Path(s["source"]).name: s["reason"] for s in report["skipped"]}
    assert reasons.pop("c.wav") == "worker crashed" and reasons.pop("nan.wav") in NAN_REASONS and not reasons
    assert "died 2 times" in next(s["detail"] for s in report["skipped"] if s["source"].endswith("c.wav"))
    assert outputs(out) == outputs(clean)


def _png_claiming(path: Path, width: int, height: int) -> Path:
    """A small PNG whose header claims ``width x height`` (its pixel data is not that size: a decoder
    would fail on it; planning must refuse it from the header alone)."""
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR width, height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # the IHDR chunk's CRC
    path.write_bytes(bytes(data))
    return path


def test_an_image_above_the_media_limits_is_refused_from_its_header(tmp_path: Path) -> None:
    """The core's limits (issue 32) hold in the offline pipeline: a 12000x12000 PNG is skipped at planning,
    named, under its own reason, without a pixel decoded; ``--media-limit`` moves the limit."""
    from PIL import Image

    folder = tmp_path / "in"
    folder.mkdir()
    Image.new("RGB", (64, 48), (10, 120, 200)).save(folder / "ok.png")
    _png_claiming(folder / "huge.png", 12_000, 12_000)
    report = _in_process("pretrain", [str(folder)], tmp_path / "a" / "out")
    (skip,) = report["skipped"]
    assert skip["source"].endswith("huge.png") and skip["reason"] == "above a media limit", skip
    assert skip["stage"] == "plan" and "12000" in skip["detail"] and "max_image_pixels" in skip["detail"], skip
    assert report["items"] == {"total": 2, "written": 1, "skipped": 1}

    # a lower limit through the command line refuses the small image too; an unknown name is refused
    done = cli(["pretrain", str(folder / "ok.png"), "--out", str(tmp_path / "b" / "out"), "--workers", "0", "--no-progress",
                "--max-bad-fraction", "1", "--media-limit", "max_image_pixels=1000", *_common()])
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "b" / "out.report.json").read_text())
    assert [s["reason"] for s in report["skipped"]] == ["above a media limit"]
    bad = cli(["pretrain", str(folder / "ok.png"), "--out", str(tmp_path / "c" / "out"), "--media-limit", "max_pixels=1",
               *_common()])
    assert bad.returncode == 2 and "max_image_pixels" in bad.stderr
