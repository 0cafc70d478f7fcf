#!/usr/bin/env python3
"""Throughput and memory of the media encoders beside the released transformers port (SPEC.md 2.1, 2.2).

Run in the reference environment: ``python3 tools/dev.py run reference python benchmarks/bench_encoders.py``.
Prints, in one run on the same inputs and the same random weights:

* items per second of this encoder and of the port (``Apertus1p5VisionTokenizerModel.encode``,
  ``WavTokenizerEncoderModel.encode``), one item per call as the released model encodes them, and
  for a batch of same-shape items; the ratio (target >= 1.0) and whether the codes are identical;
* the peak memory of encoding one 1400x1400 image: the encoder's activations, what the code
  selection adds over them (target <= 256 MiB), and the naive full score matrix of the port's
  quantizer (positions x 131,072 float32) for comparison. Memory is measured in subprocesses as
  the peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) over the
  resident size right before each step.

Sizes (2 CPU cores cannot run the released vision encoder, ~30 TFLOP per 1400x1400 image, in a
few minutes): the vision encoder keeps the released architecture (5 stages, 4 residual blocks,
attention, the 131,072 x 256 codebook) at a reduced width (``--vision-width``, default 64 for
throughput and ``--memory-width`` 32 for the 1400x1400 memory run; the released width is 256);
the audio encoder is the released WavTokenizer. The code-selection memory does not depend on the
encoder's width.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MiB = 2**20


# ---------------------------------------------------------------------- memory (subprocess worker)
def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _measure(fn) -> tuple[float, object]:
    """Peak RSS above the RSS right before ``fn`` (bytes), and ``fn``'s result."""
    import gc

    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    result = fn()
    return _status("VmHWM") - base, result


def memory_worker(mode: str, width: int, size: int, seed: int) -> dict:
    import torch

    from apertus_plugins.core.media import image
    from apertus_plugins.encoders import VisionTokenizer, VisionTokenizerConfig, select_codes_by_dot_product
    from apertus_plugins.testing.random_weights import init_random_weights

    torch.set_grad_enabled(False)
    cfg = VisionTokenizerConfig(base_channels=width)
    tok = VisionTokenizer(cfg)
    init_random_weights(tok, seed)
    rgb = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    pre = image.preprocess_image(rgb)  # 1400x1400 -> 1392x1392, 87x87 codes
    x = torch.from_numpy(pre.pixels)[None]
    del rgb
    book = tok.quantize.embedding.weight
    out: dict[str, int] = {}
    with torch.inference_mode():
        if mode == "ours":
            out["encoder"], z = _measure(lambda: tok.latents(x))
            out["select"], _ = _measure(lambda: select_codes_by_dot_product(z, book))
            del z
            out["encode"], _ = _measure(lambda: tok.encode(x))
        elif mode == "naive":  # the port's quantizer: the full positions x codebook score matrix
            z = tok.latents(x)
            out["naive"], _ = _measure(lambda: torch.nn.functional.linear(z.flatten(2).transpose(1, 2), book).argmax(-1))
        else:
            raise ValueError(mode)
    return {"mode": mode, **{k: int(v) for k, v in out.items()}, "positions": pre.grid[0] * pre.grid[1], "codebook": cfg.codebook_size,
            "pixels": [pre.height, pre.width]}


def run_worker(mode: str, width: int, size: int, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--memory-worker", mode, "--memory-width", str(width), "--memory-size",
           str(size), "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"memory worker {mode} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- throughput
@contextlib.contextmanager
def background_load(processes: int):
    """``processes`` busy-looping Python processes (one core each) for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        if procs:
            time.sleep(1.0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _threads() -> int:
    import torch

    try:
        from apertus_plugins.encoders import planned_threads
    except ImportError:  # a checkout from before the thread policy (for "before" columns)
        return torch.get_num_threads()
    return planned_threads()


def _ab(ours, port, repeat: int) -> tuple[float, float, object, object]:
    """Best-of-``repeat`` seconds of ``ours`` and ``port``, alternating runs (fair under a varying load)."""
    best = [float("inf"), float("inf")]
    results: list[object] = [None, None]
    for _ in range(repeat):
        for i, fn in enumerate((ours, port)):
            t0 = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1], results[0], results[1]


def bench_vision(width: int, repeat: int, seed: int) -> list[dict]:
    import torch
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
    from _encoder_oracles import port_image_codes, port_vision

    from apertus_plugins.core.media import image
    from apertus_plugins.encoders import VisionTokenizer, VisionTokenizerConfig, encode_images
    from apertus_plugins.testing.random_weights import init_random_weights

    tok = VisionTokenizer(VisionTokenizerConfig(base_channels=width))
    init_random_weights(tok, seed)
    port = port_vision(tok)
    rng = np.random.default_rng(seed)
    sizes = [(256, 256), (200, 330), (330, 200), (300, 300)]
    pres = []
    for h, w in sizes:
        coarse = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        pres.append(image.preprocess_image(np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC))))
    rows = []
    t_ours, t_port, ours, ref = _ab(
        lambda: encode_images(tok, pres, batch_size=1),
        lambda: [port_image_codes(port, torch.from_numpy(p.pixels)[None])[0].numpy() for p in pres], repeat)
    same = all(np.array_equal(a, b) for a, b in zip(ours, ref, strict=True))
    rows.append({"what": f"images, one per call ({len(pres)} shapes, {', '.join(f'{p.height}x{p.width}' for p in pres)})",
                 "ours": len(pres) / t_ours, "port": len(pres) / t_port, "identical": same, "threads": _threads()})
    batch = torch.from_numpy(np.stack([pres[0].pixels] * 4))
    t_ours, t_port, ours_b, ref_b = _ab(lambda: tok.encode(batch), lambda: port_image_codes(port, batch), repeat)
    rows.append({"what": "images, batch of 4 at 256x256", "ours": 4 / t_ours, "port": 4 / t_port,
                 "identical": bool(torch.equal(ours_b, ref_b)), "threads": _threads()})
    return rows


def bench_audio(repeat: int, seed: int) -> list[dict]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
    from _encoder_oracles import port_audio, port_audio_codes

    from apertus_plugins.core.media import audio
    from apertus_plugins.encoders import AudioTokenizer, AudioTokenizerConfig, encode_audio
    from apertus_plugins.testing.random_weights import init_random_weights

    tok = AudioTokenizer(AudioTokenizerConfig())
    init_random_weights(tok, seed)
    port = port_audio(tok)
    rng = np.random.default_rng(seed)
    lengths = [24_000 + 17, 3 * 24_000 + 301, 5 * 24_000 - 7, 10 * 24_000 + 450, 7_777]
    clips = [audio.preprocess_audio((0.3 * rng.standard_normal(n)).astype(np.float32), audio.SAMPLE_RATE)
             for n in lengths]
    rows = []
    t_ours, t_port, ours, ref = _ab(
        lambda: encode_audio(tok, clips, batch_size=1),
        lambda: [port_audio_codes(port, torch.from_numpy(c)[None])[0].numpy() for c in clips], 3 * repeat)
    rows.append({"what": f"clips, one per call ({len(clips)} clips, {sum(lengths) / 24_000:.1f} s)",
                 "ours": len(clips) / t_ours, "port": len(clips) / t_port,
                 "identical": all(np.array_equal(a, b) for a, b in zip(ours, ref, strict=True)), "threads": _threads()})
    batch = torch.from_numpy(np.stack([clips[2]] * 4))
    t_ours, t_port, ours_b, ref_b = _ab(lambda: tok.encode(batch), lambda: port_audio_codes(port, batch), 3 * repeat)
    rows.append({"what": "clips, batch of 4 at 5 s", "ours": 4 / t_ours, "port": 4 / t_port,
                 "identical": bool(torch.equal(ours_b, ref_b)), "threads": _threads()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vision-width", type=int, default=64, help="base channels of the throughput vision encoder")
    ap.add_argument("--memory-width", type=int, default=32, help="base channels of the 1400x1400 memory run")
    ap.add_argument("--memory-size", type=int, default=1400)
    ap.add_argument("--naive-size", type=int, default=700,
                    help="image side for measuring the port's full score matrix (1400 needs ~3.7 GiB)")
    ap.add_argument("--repeat", type=int, default=2, help="timed repetitions (best of)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--loads", default="0,1",
                    help="comma-separated numbers of busy background processes, one throughput pass each (default 0,1)")
    ap.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, args.memory_width, args.memory_size, args.seed)))
        return 0

    import torch

    loads = [int(v) for v in args.loads.split(",") if v.strip()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    if not args.skip_throughput:
        print(f"\n== throughput (vision: released architecture at width {args.vision_width}, 131,072 x 256 codebook; "
              "audio: released WavTokenizer) ==")
        print("items/s, best of alternating runs; 'load N': N busy processes beside the benchmark; "
              "threads: what this encoder used on its last call")
        table: dict[str, dict[int, dict]] = {}
        for load in loads:
            with background_load(load):
                for row in bench_vision(args.vision_width, args.repeat, args.seed) + bench_audio(args.repeat, args.seed):
                    table.setdefault(row["what"], {})[load] = row
        head = "".join(f" | {'load ' + str(n):>7s} {'ours/s':>8s} {'port/s':>8s} {'ratio':>6s} {'thr':>3s}" for n in loads)
        print(f"{'':56s}{head}  codes")
        for what, by_load in table.items():
            cells = "".join(f" | {'':7s} {r['ours']:8.3f} {r['port']:8.3f} {r['ours'] / r['port']:6.2f} {r['threads']:3d}"
                            for r in (by_load[n] for n in loads))
            same = all(r["identical"] for r in by_load.values())
            print(f"{what[:56]:56s}{cells}  {'identical' if same else 'DIFFER'}")
    if args.skip_memory:
        return 0

    print(f"\n== peak memory of one {args.memory_size}x{args.memory_size} image (encoder width {args.memory_width}, "
          "codebook 131,072 x 256; fresh process each) ==")
    enc = run_worker("ours", args.memory_width, args.memory_size, args.seed)
    naive = run_worker("naive", args.memory_width, args.naive_size, args.seed)
    positions = enc["positions"]
    naive_full = positions * enc["codebook"] * 4
    added = max(0, enc["encode"] - enc["encoder"])
    print(f"(a {args.memory_size}x{args.memory_size} image preprocesses to {enc['pixels'][0]}x{enc['pixels'][1]} pixels, "
          f"{positions} codes)")
    print(f"encoder activations (peak over baseline)            {enc['encoder'] / MiB:9.1f} MiB")
    print(f"whole encode, ours (peak over baseline)             {enc['encode'] / MiB:9.1f} MiB")
    print(f"added by code selection over the encoder's peak     {added / MiB:9.1f} MiB   (target <= 256 MiB)")
    print(f"code selection step alone, ours ({positions} positions)   {enc['select'] / MiB:9.1f} MiB")
    print(f"code selection, port's full score matrix at {args.naive_size}x{args.naive_size} ({naive['positions']} "
          f"positions): {naive['naive'] / MiB:.1f} MiB measured")
    print(f"port's full score matrix at {args.memory_size}x{args.memory_size}: {positions} x {enc['codebook']} x 4 B "
          f"= {naive_full / MiB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
