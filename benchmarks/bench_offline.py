#!/usr/bin/env python3
"""Throughput of the offline tokenization pipeline (``apertus tokenize``), stage by stage.

Prints, for one run on the same synthetic inputs (JPEG images of several sizes, WAV clips at
several rates) and the same tiny random encoders:

* planning from headers vs decoding the same items: items per second of each and their ratio
  (the plan never touches pixels or samples);
* grouping and batching one million planned items (``make_batches``): seconds;
* the same decode and encode without the pipeline, in one fresh process (the "bare" rate), and the
  whole pipeline command with the batches in the driver's process (``--workers 0``) and on 1 and 2
  local worker processes: items per second of the whole command (process start, imports, plan,
  shards, checkpoints and merge included; its ratio to bare) and of the encode stage alone, and
  the merge rate (documents per second through megatron-core's ``IndexedDatasetBuilder``);
* the cost of a resume: a run killed after half of its batches (SIGKILL through the fault hook)
  plus its resumption, against the uninterrupted run.

The encoders here are the tiny test configuration, so the encode rates measure the pipeline's
own overhead (decode, batching, shards, checkpoints), not a production encoder. Run in the
``megatron`` environment::

    python benchmarks/bench_offline.py [--images 96] [--clips 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = [(240, 320), (256, 256), (384, 512), (300, 400), (270, 480), (188, 250)]
RATES = [16000, 22050, 24000, 44100]


def make_inputs(root: Path, images: int, clips: int) -> None:
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    (root / "aud").mkdir(parents=True)
    for k in range(images):
        h, w = SIZES[k % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w]
        base = ((x * (k + 3) + y * 7) % 256).astype(np.uint8)
        arr = np.stack([base, base[::-1], np.roll(base, k, axis=1)], axis=-1)
        arr = np.clip(arr.astype(np.int16) + rng.integers(-20, 20, arr.shape), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(root / "img" / f"{k:05d}.jpg", quality=85)
    for k in range(clips):
        rate = RATES[k % len(RATES)]
        n = int(rate * (1 + (k % 4)))  # 1 to 4 seconds: clips of equal length share a batch
        buf = io.BytesIO()
        sf.write(buf, (rng.standard_normal(n) * 0.1).astype(np.float32), rate, format="WAV", subtype="PCM_16")
        (root / "aud" / f"{k:05d}.wav").write_bytes(buf.getvalue())


def bench_plan(root: Path) -> None:
    from apertus_plugins.core.media.audio import load_audio, preprocess_audio
    from apertus_plugins.core.media.image import preprocess_image
    from apertus_plugins.data.offline.plan import make_batches
    from apertus_plugins.data.offline.sources import Item, MediaRef, scan_pretrain

    t = time.perf_counter()
    items, _skips, _ = scan_pretrain([str(root)], "released", "released")
    plan_s = time.perf_counter() - t
    t = time.perf_counter()
    for it in items:
        ref = it.media[0]
        if ref.kind == "image":
            preprocess_image(ref.path)
        else:
            preprocess_audio(*load_audio(ref.path))
    decode_s = time.perf_counter() - t
    n = len(items)
    print(f"plan from headers      {n / plan_s:10.1f} items/s")
    print(f"decode + preprocess    {n / decode_s:10.1f} items/s   (headers are {decode_s / plan_s:.0f}x faster)")
    rnd = random.Random(0)
    shapes = [[h, w] for h in range(128, 1400, 16) for w in (h, h + 16, h * 2 // 16 * 16)]
    many = [Item(i, "image", f"x{i}", [MediaRef("image", "x", "x", shape=s, codes=s[0] * s[1] // 256)])
            for i, s in enumerate(rnd.choice(shapes) for _ in range(1_000_000))]
    t = time.perf_counter()
    batches = make_batches(many, "pretrain", 32, 65536, 4096)
    print(f"batch 1,000,000 items  {time.perf_counter() - t:10.2f} s       ({len(batches):,} shape-uniform batches)")


def run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, float]:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "tokenize", *args], capture_output=True,
                         text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    if res.returncode not in (0, -9):
        raise SystemExit(f"tokenize failed:\n{res.stdout}\n{res.stderr}")
    return res.returncode, time.perf_counter() - t


BARE = """
import sys
from pathlib import Path
from apertus_plugins.encoders import encode_audio, encode_images, load_audio_tokenizer, load_vision_tokenizer
from apertus_plugins.core.media.audio import load_audio, preprocess_audio
from apertus_plugins.core.media.image import preprocess_image
root, ckpt = Path(sys.argv[1]), sys.argv[2]
vision, audio = load_vision_tokenizer(ckpt), load_audio_tokenizer(ckpt)
files = sorted((root / "img").iterdir()) + sorted((root / "aud").iterdir())
encode_images(vision, [preprocess_image(f).pixels for f in files if f.suffix == ".jpg"], batch_size=16)
encode_audio(audio, [preprocess_audio(*load_audio(f)) for f in files if f.suffix == ".wav"], batch_size=16)
print(len(files))
"""


def bare_wall(root: Path, ckpt: Path) -> float:
    """Seconds of the same work without the pipeline: one fresh process decodes, preprocesses and encodes
    every item in shape-grouped batches and writes nothing (process start and imports included)."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", BARE, str(root), str(ckpt)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr)
    return time.perf_counter() - t


def bench_run(root: Path, ckpt: Path, repeat: int) -> None:
    """Best of ``repeat`` interleaved rounds (the machine may be shared: the minimum is the least disturbed)."""
    base = ["pretrain", str(root / "img"), str(root / "aud"), "--tokenizer", str(ckpt), "--checkpoint", str(ckpt),
            "--batch-size", "16", "--no-progress"]
    n = len(list((root / "img").iterdir())) + len(list((root / "aud").iterdir()))
    best: dict[object, float] = {}
    runs: dict[int, dict] = {}
    for r in range(repeat):
        best["bare"] = min(best.get("bare", float("inf")), bare_wall(root, ckpt))
        for workers in (0, 1, 2):
            out = root / f"out-w{workers}-{r}" / "data"
            _, wall = run_cli([*base, "--out", str(out), "--workers", str(workers)])
            if wall < best.get(workers, float("inf")):
                best[workers] = wall
                runs[workers] = {"out": out, **json.loads(Path(f"{out}.report.json").read_text())["run"]}
    bare = n / best["bare"]
    print(f"bare decode+encode     {bare:10.2f} items/s   (a fresh process, imports included, nothing written; "
          f"{best['bare']:.1f} s)")
    for workers in (0, 1, 2):
        r, wall = runs[workers], best[workers]
        print(f"pipeline, workers {workers}: whole command {n / wall:6.2f} items/s ({wall:5.1f} s, {n / wall / bare:.2f}x "
              f"bare), encode stage {r['items_per_s']:6.2f} items/s, merge {n / max(r['merge_s'], 1e-9):8.0f} docs/s")
    first = Path(f"{runs[0]['out']}.bin").read_bytes()
    same = all(Path(f"{runs[w]['out']}.bin").read_bytes() == first for w in (1, 2))
    print(f"outputs identical across worker counts: {same}")
    out = root / "out-resume" / "data"
    batches = runs[2]["batches"]
    total = 0.0
    for env in ({"APERTUS_TOKENIZE_FAULT": f"batch-done:{batches // 2}"}, None):
        _, wall = run_cli([*base, "--out", str(out), "--workers", "2"], env)
        total += wall
    same = Path(f"{out}.bin").read_bytes() == first
    print(f"killed after batch {batches // 2} of {batches}, then resumed: {total:5.1f} s in all vs {best[2]:5.1f} s "
          f"uninterrupted (best of {repeat}); identical: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the pipeline runs; the best is printed")
    args = ap.parse_args()
    from apertus_plugins.testing.checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-offline-") as tmp:
        root = Path(tmp)
        make_inputs(root / "in", args.images, args.clips)
        ckpt = write_checkpoint(root / "ckpt", size="tiny")
        print(f"{args.images} JPEG images ({len(SIZES)} sizes up to 384x512), {args.clips} WAV clips (1-4 s, "
              f"{len(RATES)} rates), tiny random encoders, {os.cpu_count()} CPUs")
        bench_plan(root / "in")
        bench_run(root / "in", ckpt, args.repeat)


if __name__ == "__main__":
    main()
