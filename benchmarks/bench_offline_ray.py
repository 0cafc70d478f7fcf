#!/usr/bin/env python3
"""The distributed offline pipeline (``apertus tokenize`` on Ray) side by side with the pipeline before it.

One run prints:

* planning: items/s of the whole planning stage (listing, scanning headers, batching, the plan
  files) on a local Ray cluster of 1 and of 2 CPUs (one and two worker processes), on the same
  WebDataset shards of small images, and the ratio;
* memory: the peak resident memory of the driver and of every planning worker process when planning
  10,000, 100,000 and 1,000,000 items (tar shards of 10,000 items; flat is the target);
* end to end, on the same JPEG images (384x384 and 352x416) with a vision encoder large enough to
  be the slow part (the tiny test structure with two residual blocks per stage): items/s
  of today's pipeline (the code before it was distributed, ``git archive BASELINE``, with 1 and 2
  local workers), of the new pipeline on 2 local workers and on a 2-CPU Ray cluster (decode tasks
  ahead of one encoder actor); the encoder's utilisation (seconds in the encoder over the encoder
  processes' seconds since they loaded it; and over the whole encode stage, start-up included);
  whether every output is byte-identical;
* the estimate for tokenizing 1 billion 512x512 images on H200 GPUs, from the released vision
  encoder's FLOP count (:mod:`apertus_plugins.encoders.flops`), the assumed H200 throughput and
  encoder utilisation (printed) and the figures measured above (planning items/s per worker,
  decode + resize items/s per CPU core).

Run in the ``megatron`` environment (it starts and stops its own Ray heads on loopback; hold the
heavy-job lock on a shared machine)::

    python benchmarks/bench_offline_ray.py [--plan-items 10000,100000,1000000] [--images 48]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "6f13768"  # the pipeline before planning, encoding and merging were distributed
PER_TAR = 10_000
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local head, no token (Ray 2.60 enables it by default)

# assumed H200 SXM figures (NVIDIA's data sheet, dense, no sparsity) and the achieved fraction of them
H200_FP32 = 67e12  # FP32 on CUDA cores, FLOP/s
H200_TF32 = 494.7e12  # TF32 tensor cores, dense (989.4e12 is the figure with 2:4 sparsity)
CONV_EFFICIENCY = 0.5  # share of peak the encoder's 3x3 convolutions reach (cuDNN; not measured here)
# the encoders' busy share assumed on GPUs: the target (the report's pipeline: about 0.92); measured here
# on CPU, where the encoder is ~100x slower than on an H200 and so easier to keep busy, it is printed beside
UTILISATION = 0.9


# ---------------------------------------------------------------------- Ray heads
class RayHead:
    """``ray start --head --block`` on loopback in its own process group; stopped by signalling that group."""

    def __init__(self, cpus: int) -> None:
        self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.ray = str(Path(sys.executable).parent / "ray")
        self.proc = subprocess.Popen(
            [self.ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", str(cpus), "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
             "--object-store-memory", str(300 * 2**20), "--temp-dir", self.temp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        deadline = time.monotonic() + 180
        while subprocess.run([self.ray, "status", "--address", self.address], capture_output=True).returncode:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("the Ray head did not start")
            time.sleep(1)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        self.proc.wait(timeout=60)
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


# ---------------------------------------------------------------------- inputs
def make_tars(root: Path, items: int) -> list[Path]:
    """``items`` small PNG images (8 sizes) in tar shards of 10,000 (the bytes of 8 images, repeated)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    blobs = []
    for h, w in [(32, 32), (32, 48), (48, 32), (64, 64), (40, 56), (56, 40), (16, 96), (96, 16)]:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        blobs.append(buf.getvalue())
    root.mkdir(parents=True, exist_ok=True)
    tars = []
    for t in range(-(-items // PER_TAR)):
        path = root / f"shard-{t:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for k in range(t * PER_TAR, min(items, (t + 1) * PER_TAR)):
                data = blobs[k % len(blobs)]
                info = tarfile.TarInfo(f"{k:08d}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        tars.append(path)
    return tars


def make_images(root: Path, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    for k in range(n):
        h, w = (384, 384) if k % 3 else (352, 416)
        y, x = np.mgrid[0:h, 0:w]
        base = ((x * (k + 3) + y * 7) % 256).astype(np.uint8)
        arr = np.stack([base, base[::-1], np.roll(base, k, axis=1)], axis=-1)
        arr = np.clip(arr.astype(np.int16) + rng.integers(-20, 20, arr.shape), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(root / f"{k:05d}.jpg", quality=85)


def slow_checkpoint(out: Path) -> Path:
    """The tiny random checkpoint with a wider vision encoder (two residual blocks per stage)."""
    from dataclasses import replace

    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.encoders.config import VisionTokenizerConfig
    from apertus_plugins.testing.checkpoint import write_checkpoint

    spec = VocabSpec.scaled()
    vision = replace(VisionTokenizerConfig.tiny(), num_res_blocks=2, codebook_size=spec.modality("image").size)
    return write_checkpoint(out, size="tiny", vision_config=vision)


# ---------------------------------------------------------------------- runs
def tokenize(args: list[str], pythonpath: Path = ROOT) -> float:
    """Seconds of one ``apertus tokenize`` command (a fresh process: imports and start-up included)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "tokenize", *args], capture_output=True,
                         text=True, env=env, start_new_session=True, cwd=pythonpath)  # -m puts the cwd first
    if res.returncode:
        raise SystemExit(f"tokenize {' '.join(args[:3])}... failed:\n{res.stdout}\n{res.stderr}")
    return time.perf_counter() - t


def plan_run(tars: list[Path], out: Path, ckpt: Path, address: str) -> dict:
    tokenize(["pretrain", *map(str, tars), "--out", str(out), "--tokenizer", str(ckpt), "--checkpoint", str(ckpt),
              "--no-progress", "--plan-only", "--ray-address", address])
    work = Path(f"{out}.work")
    summary = json.loads((work / "plan-summary.json").read_text())
    workers: dict[int, float] = {}
    for f in list((work / "plan" / "scan").glob("s*.json")) + list((work / "plan" / "batches").glob("p*.json")):
        w = json.loads(f.read_text())["worker"]
        workers[w["pid"]] = max(workers.get(w["pid"], 0.0), w["peak_rss_mb"])
    summary["workers_peak_rss_mb"] = sorted(workers.values())
    shutil.rmtree(work)
    return summary


def bench_planning(root: Path, ckpt: Path, sizes: list[int]) -> dict:
    t = time.perf_counter()
    tars = make_tars(root / "tars", max(sizes))
    print(f"inputs: {max(sizes):,} PNG images in {len(tars)} tar shards of {PER_TAR:,} ({time.perf_counter() - t:.0f} s "
          "to write)")
    mid = sorted(sizes)[len(sizes) // 2]
    rates = {}
    for cpus in (1, 2):
        with RayHead(cpus) as head:
            s = plan_run(tars[: -(-mid // PER_TAR)], root / f"plan-{cpus}" / "x", ckpt, head.address)
            rates[cpus] = s["items"] / s["plan_s"]
            print(f"planning {s['items']:,} items, Ray with {cpus} worker(s): {rates[cpus]:8,.0f} items/s "
                  f"({s['plan_s']:.1f} s; header scan alone {s['scan_items_per_s']:,.0f} items/s)")
            if cpus == 2:
                print(f"  2 workers / 1 worker: {rates[2] / rates[1]:.2f}x")
                memory = {}
                for n in sorted(sizes):
                    m = plan_run(tars[: -(-n // PER_TAR)], root / f"mem-{n}" / "x", ckpt, head.address)
                    memory[n] = m
                    w = m["workers_peak_rss_mb"]
                    print(f"  peak memory planning {n:>9,} items: driver {m['peak_rss_mb']['driver']:6.0f} MiB, "
                          f"workers {', '.join(f'{x:.0f}' for x in w)} MiB ({m['batches']:,} batches, "
                          f"{m['shards']} shards, {m['plan_s']:.0f} s)")
    return {"rates": rates, "memory": memory}


def bench_end_to_end(root: Path, n: int) -> dict:
    make_images(root / "img", n)
    ckpt = slow_checkpoint(root / "ckpt-slow")
    base = ["pretrain", str(root / "img"), "--tokenizer", str(ckpt), "--checkpoint", str(ckpt), "--batch-size", "8",
            "--no-progress"]
    runs: dict[str, dict] = {}
    baseline = root / "baseline"
    baseline.mkdir()
    got = subprocess.run(f"git -C {ROOT} archive {BASELINE} apertus_plugins | tar -x -C {baseline}", shell=True,
                         capture_output=True, text=True)
    if got.returncode == 0:
        for w in (1, 2):
            out = root / f"today-w{w}" / "x"
            wall = tokenize([*base, "--out", str(out), "--workers", str(w)], pythonpath=baseline)
            runs[f"today, {w} local worker{'s' if w > 1 else ''}"] = {"wall": wall, "out": out, **_run(out)}
    else:
        print(f"(today's pipeline, commit {BASELINE}, is not in this clone's history: not run)")
    out = root / "new-w2" / "x"
    wall = tokenize([*base, "--out", str(out), "--workers", "2"])
    runs["new, 2 local workers"] = {"wall": wall, "out": out, **_run(out)}
    with RayHead(2) as head:
        out = root / "new-ray" / "x"
        wall = tokenize([*base, "--out", str(out), "--ray-address", head.address])
        runs["new, Ray (2 CPUs: decode tasks, 1 encoder actor)"] = {"wall": wall, "out": out, **_run(out)}
    first = None
    for name, r in runs.items():
        data = Path(f"{r['out']}.bin").read_bytes() + Path(f"{r['out']}.idx").read_bytes()
        first = first or data
        util = r.get("encoder_utilisation")
        share = (f"encoders busy {util:.2f} of their time (of the whole stage: {r['encoder_share_of_stage']:.2f})"
                 if util is not None else "encoder time not recorded")
        print(f"{name:52s} {n / r['wall']:6.2f} items/s whole command ({r['wall']:5.1f} s), encode stage "
              f"{r['items_per_s']:6.2f} items/s, {share}; identical: {data == first}")
    return runs


def _run(out: Path) -> dict:
    return json.loads(Path(f"{out}.report.json").read_text())["run"]


def decode_rate() -> float:
    """Decode + resize items/s of a 512x512 JPEG on one core of this machine."""
    from PIL import Image

    from apertus_plugins.core.media.image import preprocess_image

    rng = np.random.default_rng(2)
    buf = io.BytesIO()
    y, x = np.mgrid[0:512, 0:512]
    arr = np.stack([(x + y) % 256, (x * 3) % 256, (y * 5) % 256], axis=-1).astype(np.uint8)
    arr = np.clip(arr.astype(np.int16) + rng.integers(-20, 20, arr.shape), 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    preprocess_image(data)
    t = time.perf_counter()
    k = 0
    while time.perf_counter() - t < 3:
        preprocess_image(data)
        k += 1
    return k / (time.perf_counter() - t)


def estimate(measured: float, plan_rate: float, decode: float) -> None:
    from apertus_plugins.core.media.image import LAYOUTS, resized_size
    from apertus_plugins.encoders.config import VisionTokenizerConfig
    from apertus_plugins.encoders.flops import vision_flops

    h, w = resized_size(512, 512)
    f = vision_flops(VisionTokenizerConfig(), h, w)
    tokens = LAYOUTS["training"].num_ids(h // 16, w // 16, len(f"{h // 16}*{w // 16}")) + 2
    n = 1e9
    print(f"\n1 billion {h}x{w} images on H200 (assumed, dense: FP32 {H200_FP32 / 1e12:.0f} TFLOP/s, TF32 tensor "
          f"{H200_TF32 / 1e12:.1f} TFLOP/s; the encoder's convolutions at {CONV_EFFICIENCY:.0%} of peak; the encoders "
          f"busy {UTILISATION:.2f} of the time; measured above on CPU: {measured:.2f})")
    print(f"  released vision encoder: {f.total / 1e12:.2f} TFLOP per image ({f.conv / f.total:.1%} convolutions); "
          f"{tokens:,} tokens per document, {n * tokens * 4 / 1e12:,.1f} TB of int32 ids")
    for name, peak in (("float32", H200_FP32), ("tf32", H200_TF32)):
        rate = peak * CONV_EFFICIENCY / f.total * UTILISATION
        gpu_h = n / rate / 3600
        print(f"  --precision {name:7s}: {rate:6.1f} images/s per GPU, {gpu_h:>9,.0f} GPU-hours: {gpu_h / 24:>7,.0f} "
              f"GPUs for one day, {gpu_h / 24 / 7:>6,.0f} for a week; decode + resize needs {rate / decode:5.2f} CPU "
              "cores per GPU")
    print(f"  planning: {n / plan_rate / 3600:,.1f} worker-hours of header reads at {plan_rate:,.0f} items/s per "
          f"worker (measured here; {n / plan_rate / 3600 / 256:.2f} h on 256 CPU workers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-items", default="10000,100000,1000000", help="planned items for the memory figures")
    ap.add_argument("--images", type=int, default=64, help="images of the end-to-end runs")
    ap.add_argument("--skip-planning", action="store_true")
    args = ap.parse_args()
    from apertus_plugins.testing.checkpoint import write_checkpoint

    sizes = [int(x) for x in args.plan_items.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        root = Path(tmp)
        print(f"{os.cpu_count()} CPUs; Ray {__import__('ray').__version__}")
        plan_rate = None
        if not args.skip_planning:
            ckpt = write_checkpoint(root / "ckpt", size="tiny")
            planning = bench_planning(root / "plan", ckpt, sizes)
            shutil.rmtree(root / "plan" / "tars")
            plan_rate = planning["rates"][1]
        runs = bench_end_to_end(root / "e2e", args.images)
        ray_run = next(r for k, r in runs.items() if "Ray" in k)
        dec = decode_rate()
        print(f"decode + resize of a 512x512 JPEG: {dec:.0f} items/s on one core")
        estimate(ray_run["encoder_utilisation"], plan_rate or 3000.0, dec)


if __name__ == "__main__":
    main()
