#!/usr/bin/env python3
"""The worst case of one item in ``apertus tokenize``: time and peak memory of a maximal image and a long clip.

Each measurement runs in a fresh process (its peak resident memory is its own) and goes through
the pipeline's own media calls (``apertus_plugins.data.offline.preprocess.MediaSettings``, what a worker
runs per item): the header read at planning time, then decoding and preprocessing, then the tiny
test encoder on the result (an image is resized to at most 1400x1400 before the encoder, so the
encoder's cost of an image is bounded; a clip's grows with its length).

* the largest PNG Pillow decodes without refusing it (just under twice ``PIL.Image.MAX_IMAGE_PIXELS``,
  13,377 x 13,377; one flat colour, so the file is small: a few hundred kB), and a 12,000 x 12,000 one;
* WAV clips of 10 and 60 minutes, 48 kHz stereo 16-bit (the encoder on the 10-minute clip only).

Prints one table row per item: file size, planning, decoding and preprocessing, encoding, and the
process's peak memory. Run in the ``megatron`` environment::

    python benchmarks/bench_offline_item.py [--minutes 10 60] [--sides 12000 13377]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _png(path: Path, side: int) -> None:
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # writing it, not reading it
    Image.new("RGB", (side, side), (90, 140, 200)).save(path, "PNG", compress_level=9)


def _wav(path: Path, minutes: float, rate: int = 48000) -> None:
    import numpy as np
    import soundfile as sf

    n = int(minutes * 60 * rate)
    with sf.SoundFile(path, "w", samplerate=rate, channels=2, subtype="PCM_16", format="WAV") as fh:
        rng = np.random.default_rng(0)
        step = rate * 60
        for start in range(0, n, step):
            fh.write((rng.standard_normal((min(step, n - start), 2)) * 0.1).astype(np.float32))


def _one(kind: str, path: str, checkpoint: str | None) -> dict:
    """In this (fresh) process: header, decode + preprocess, encode (with ``checkpoint``)."""
    sys.path.insert(0, str(ROOT))
    from apertus_plugins.data.offline.preprocess import MediaSettings
    from apertus_plugins.data.offline.sources import MediaRef, media_shape

    media = MediaSettings()
    out: dict = {"bytes": os.path.getsize(path)}
    ref = MediaRef(kind, path, path)
    t = time.perf_counter()
    media_shape(ref, media)
    out["plan_s"] = time.perf_counter() - t
    out["shape"] = ref.shape
    data = Path(path).read_bytes()
    t = time.perf_counter()
    arr = media.image(data) if kind == "image" else media.audio(data)
    out["decode_s"] = time.perf_counter() - t
    del data
    out["decode_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if checkpoint:
        from apertus_plugins.data.offline.encode import MediaEncoders

        enc = MediaEncoders(checkpoint, "cpu")
        enc.load(kind)
        t = time.perf_counter()
        enc.encode(kind, [arr])
        out["encode_s"] = time.perf_counter() - t
    out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _measure(kind: str, path: Path, checkpoint: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--one", kind, str(path)] + (["--checkpoint", str(checkpoint)] if checkpoint else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", type=int, nargs="+", default=[12000, 13377])
    p.add_argument("--minutes", type=float, nargs="+", default=[10, 60])
    p.add_argument("--encode-minutes", type=float, default=10, help="encode clips up to this length (the tiny encoder)")
    p.add_argument("--one", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.checkpoint)))
        return
    sys.path.insert(0, str(ROOT))
    from apertus_plugins.testing.checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-item-") as tmp:
        root = Path(tmp)
        ckpt = write_checkpoint(root / "ckpt", size="tiny")
        rows = []
        for side in args.sides:
            path = root / f"flat-{side}.png"
            _png(path, side)
            rows.append((f"PNG {side:,} x {side:,} ({side * side / 1e6:.0f} MP)", _measure("image", path, ckpt)))
        for minutes in args.minutes:
            path = root / f"clip-{minutes:g}min.wav"
            _wav(path, minutes)
            enc = ckpt if minutes <= args.encode_minutes else None
            rows.append((f"WAV {minutes:g} min, 48 kHz stereo", _measure("audio", path, enc)))
    print(f"one item in a fresh process, {os.cpu_count()} CPUs; the tiny test encoder")
    print(f"{'item':34} {'file':>9} {'plan (header)':>14} {'decode+prep':>12} {'encode':>8} {'peak RSS':>10}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:34} refused or failed: {r['error'][:120]}")
            continue
        enc = f"{r['encode_s']:.1f} s" if "encode_s" in r else "-"
        print(f"{name:34} {r['bytes'] / 2**20:7.1f}MB {r['plan_s'] * 1000:11.1f} ms {r['decode_s']:10.1f} s {enc:>8} "
              f"{r['peak_mb'] / 1024:8.2f}GB   (decoded {r['decode_peak_mb'] / 1024:.2f} GB; shape {r['shape']})")


if __name__ == "__main__":
    main()
