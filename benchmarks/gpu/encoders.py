#!/usr/bin/env python3
"""GPU throughput and exactness of the media encoders, float32 and TF32, against their FLOP floor.

One command, a few minutes on one GPU (released sizes, random weights with calibrated codebooks)::

    python benchmarks/gpu/encoders.py                # needs torch with CUDA
    python benchmarks/gpu/encoders.py --cpu-test     # the same path on CPU at tiny sizes (a smoke test)

Prints, per precision (``float32``, ``tf32``):

* the device's measured rates: a large float32 matmul and a 3x3 convolution (FLOP/s);
* images/s at 512x512 and clips/s at 10 s (same-shape batches of ``--batch``), beside the ceiling
  that the encoder's FLOPs (counted from the architecture, :mod:`apertus_plugins.encoders.flops`)
  allow at the measured rates (convolutions at the conv rate, products and the codebook search at
  the matmul rate), and the fraction of it reached;
* exactness: the GPU codes of ``--check-images`` images and ``--check-clips`` clips against the
  CPU's float32 codes of the same inputs and weights: how many codes differ in float32 (expected 0;
  a near tie can flip in principle) and in TF32.

Writes the figures as JSON to ``--out`` (default ``$OUT/encoders_gpu.json`` when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(msg, flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device, repeat: int, warmup: int = 1) -> float:
    """Mean wall seconds of ``fn`` over ``repeat`` calls after ``warmup`` calls (synchronized)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeat


def device_rates(device, precision: str, size: int, repeat: int) -> dict[str, float]:
    """Measured FLOP/s of a ``size``^3 matmul and of a 3x3 256->256 convolution at ``precision``."""
    import torch
    import torch.nn.functional as F

    from apertus_plugins.encoders import precision_scope

    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn((size, size), generator=gen).to(device)
    b = torch.randn((size, size), generator=gen).to(device)
    side = 128 if device.type == "cuda" else 32
    batch = 8 if device.type == "cuda" else 1
    x = torch.randn((batch, 256, side, side), generator=gen).to(device)
    w = torch.randn((256, 256, 3, 3), generator=gen).to(device)
    with torch.inference_mode(), precision_scope(precision):
        t_mm = _seconds(lambda: torch.mm(a, b), device, repeat)
        t_conv = _seconds(lambda: F.conv2d(x, w, padding=1), device, repeat)
    return {"matmul_flops_per_s": 2.0 * size**3 / t_mm,
            "conv_flops_per_s": 2.0 * 256 * 256 * 9 * side * side * batch / t_conv}


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


def ceiling(count, rates: dict[str, float]) -> float:
    """Items/s the FLOPs allow at the measured rates (one item's count)."""
    seconds = count.conv / rates["conv_flops_per_s"] + (count.matmul + count.codebook) / rates["matmul_flops_per_s"]
    return 1.0 / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-test", action="store_true", help="run on CPU at tiny sizes (tests the script, no GPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--image-size", type=int, default=512)
    ap.add_argument("--clip-seconds", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=8, help="same-shape items per forward pass")
    ap.add_argument("--batches", type=int, default=4, help="timed batches per measurement")
    ap.add_argument("--check-images", type=int, default=2)
    ap.add_argument("--check-clips", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch

    from apertus_plugins.encoders import (
        AudioTokenizer,
        AudioTokenizerConfig,
        PrecisionError,
        VisionTokenizer,
        VisionTokenizerConfig,
        audio_flops,
        vision_flops,
    )
    from apertus_plugins.testing.random_weights import init_random_weights

    t_start = time.perf_counter()
    if args.cpu_test:
        device = torch.device("cpu")
        vcfg, acfg = VisionTokenizerConfig.tiny(), AudioTokenizerConfig.tiny()
        image_size, clip_samples, batch, mm_size = 128, 24_000, 2, 512
    else:
        if not torch.cuda.is_available():
            log("error: no CUDA device visible to torch (use --cpu-test to run the CPU path)")
            return 2
        device = torch.device(args.device)
        vcfg, acfg = VisionTokenizerConfig(), AudioTokenizerConfig()
        image_size, clip_samples, batch, mm_size = args.image_size, int(args.clip_seconds * 24_000), args.batch, 8192
    torch.backends.cudnn.benchmark = False  # heuristic algorithm choice, the same on every run
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    log(f"device {name}, torch {torch.__version__}, vision {'tiny' if args.cpu_test else 'released'} "
        f"({vcfg.base_channels} base channels, {vcfg.codebook_size} codes), audio {acfg.num_filters} filters, "
        f"{acfg.codebook_size} codes")

    vision_cpu, audio_cpu = VisionTokenizer(vcfg), AudioTokenizer(acfg)
    init_random_weights(vision_cpu, args.seed)
    init_random_weights(audio_cpu, args.seed + 1)
    log(f"random weights ready in {time.perf_counter() - t_start:.1f} s")
    vision = VisionTokenizer(vcfg).to(device)
    vision.load_state_dict(vision_cpu.state_dict())
    audio = AudioTokenizer(acfg).to(device)
    audio.load_state_dict(audio_cpu.state_dict())

    gen = torch.Generator().manual_seed(args.seed)
    images = (torch.rand((batch, 3, image_size, image_size), generator=gen) * 2 - 1)
    t = torch.arange(clip_samples) / 24_000
    clips = (0.4 * torch.sin(2 * torch.pi * (200 + 800 * torch.rand((batch, 1), generator=gen)) * t * (1 + t))
             + 0.1 * torch.randn((batch, clip_samples), generator=gen)).float()
    images_dev, clips_dev = images.to(device), clips.to(device)
    v_count = vision_flops(vcfg, image_size, image_size)
    a_count = audio_flops(acfg, clip_samples)
    log(f"FLOPs per image at {image_size}x{image_size}: {v_count.total / 1e9:.1f} G (conv {v_count.conv / 1e9:.1f}, "
        f"attention {v_count.matmul / 1e9:.1f}, codebook {v_count.codebook / 1e9:.1f}); per clip of "
        f"{clip_samples / 24_000:g} s: {a_count.total / 1e9:.2f} G (conv {a_count.conv / 1e9:.2f}, "
        f"LSTM {a_count.matmul / 1e9:.2f}, codebook {a_count.codebook / 1e9:.2f})")

    results: dict = {"device": name, "torch": torch.__version__, "image_size": image_size,
                     "clip_samples": clip_samples, "batch": batch, "vision_flops": v_count.total,
                     "audio_flops": a_count.total, "precisions": {}}
    codes_by_precision: dict[str, tuple] = {}
    for precision in ("float32", "tf32"):
        try:
            vision.precision = audio.precision = precision
            vision.check_ready()
        except PrecisionError as exc:
            vision.precision = audio.precision = "float32"
            log(f"\n[{precision}] skipped: {exc}")
            results["precisions"][precision] = {"skipped": str(exc)}
            continue
        rates = device_rates(device, precision, mm_size, repeat=5)
        t_img = _seconds(lambda: vision.encode(images_dev), device, args.batches)
        t_clip = _seconds(lambda: audio.encode(clips_dev), device, args.batches)
        img_s, clip_s = batch / t_img, batch / t_clip
        img_ceiling, clip_ceiling = ceiling(v_count, rates), ceiling(a_count, rates)
        row = {**rates, "images_per_s": img_s, "images_per_s_ceiling": img_ceiling,
               "clips_per_s": clip_s, "clips_per_s_ceiling": clip_ceiling}
        results["precisions"][precision] = row
        log(f"\n[{precision}] measured matmul {_rate(rates['matmul_flops_per_s'])}, "
            f"3x3 conv {_rate(rates['conv_flops_per_s'])}")
        log(f"  images/s at {image_size}x{image_size}: {img_s:8.2f}   FLOP ceiling {img_ceiling:8.2f}   "
            f"({img_s / img_ceiling:.0%} of it)")
        log(f"  clips/s at {clip_samples / 24_000:g} s:     {clip_s:8.2f}   FLOP ceiling {clip_ceiling:8.2f}   "
            f"({clip_s / clip_ceiling:.0%} of it)")
        n_img, n_clip = min(args.check_images, batch), min(args.check_clips, batch)
        codes_by_precision[precision] = (vision.encode(images_dev[:n_img]).cpu(), audio.encode(clips_dev[:n_clip]).cpu())

    log("\nexactness against the CPU's float32 codes (same inputs and weights)")
    t0 = time.perf_counter()
    n_img, n_clip = min(args.check_images, batch), min(args.check_clips, batch)
    cpu_img = torch.cat([vision_cpu.encode(images[i : i + 1]) for i in range(n_img)])
    cpu_clip = torch.cat([audio_cpu.encode(clips[i : i + 1]) for i in range(n_clip)])
    log(f"  (CPU reference of {n_img} images and {n_clip} clips in {time.perf_counter() - t0:.1f} s)")
    for precision, (img_codes, clip_codes) in codes_by_precision.items():
        d_img = int((img_codes != cpu_img).sum())
        d_clip = int((clip_codes != cpu_clip).sum())
        results["precisions"][precision].update({"image_codes_differing": d_img, "image_codes": cpu_img.numel(),
                                                  "audio_codes_differing": d_clip, "audio_codes": cpu_clip.numel()})
        log(f"  [{precision}] image codes differing: {d_img} of {cpu_img.numel()} ({d_img / cpu_img.numel():.4%}); "
            f"audio codes differing: {d_clip} of {cpu_clip.numel()} ({d_clip / cpu_clip.numel():.4%})")
    distinct = len(np.unique(cpu_img.numpy()))
    log(f"  ({distinct} distinct image codes in the check: the random codebook is not degenerate)")
    results["seconds"] = time.perf_counter() - t_start
    out = args.out or (os.path.join(os.environ["OUT"], "encoders_gpu.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {out}")
    log(f"done in {results['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
