#!/usr/bin/env python3
"""A 512x512 image encoded cold against read back from the persistent media-code cache.

Run in an environment with torch (the reference suite's):
``python3 tools/dev.py run reference python benchmarks/bench_media_cache.py``.

For each vision encoder (the tiny random checkpoint of ``apertus make-checkpoint``, and the released
architecture at a reduced width, ``--widths``), written as a checkpoint and loaded by the same
loader ``apertus encode`` uses, it prints the best of ``--repeat`` runs of

* ``preprocess``: decode and resize (the cache does not save it: the key is the preprocessed pixels),
* ``cold``: ``encode_images`` without the cache,
* ``miss``: with the cache, an item it lacks (encode + key + atomic write),
* ``hit``: with the cache, an item it holds (key + checked read), in a fresh ``MediaCodeCache`` as
  another process would see it,
* ``fingerprint``: the one-time digest of the encoder's weights (per loaded encoder),

and the ratios cold/hit and (preprocess+cold)/(preprocess+hit).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _row(width: str, tmp: Path, png: bytes, image_codes: int, repeat: int) -> str:
    from apertus_plugins.core.media import image
    from apertus_plugins.encoders import encode_images, load_vision_tokenizer
    from apertus_plugins.encoders.cache import MediaCodeCache, forget_fingerprint, weights_fingerprint
    from apertus_plugins.encoders.config import VisionTokenizerConfig
    from apertus_plugins.testing.checkpoint import write_checkpoint

    vision = None if width == "tiny" else dataclasses.replace(
        VisionTokenizerConfig(), base_channels=int(width), codebook_size=image_codes)
    ckpt = write_checkpoint(tmp / f"ck-{width}", vision_config=vision)
    tok = load_vision_tokenizer(ckpt)
    t_pre, pre = _best(lambda: image.preprocess_image(image.decode_image(image.open_image(png))), repeat)
    t_cold, cold = _best(lambda: encode_images(tok, [pre], batch_size=1), repeat)

    def fingerprint() -> str:
        forget_fingerprint(tok)
        return weights_fingerprint(tok)

    t_fp, _ = _best(fingerprint, repeat)
    cache_dir = tmp / f"codes-{width}"

    def miss() -> list:
        for f in cache_dir.rglob("*.bin"):
            f.unlink()
        return encode_images(tok, [pre], batch_size=1, cache=MediaCodeCache(cache_dir))

    t_miss, _ = _best(miss, repeat)
    t_hit, hit = _best(lambda: encode_images(tok, [pre], batch_size=1, cache=MediaCodeCache(cache_dir)), repeat)
    assert np.array_equal(cold[0], hit[0]), "the cache returned other codes"  # type: ignore[index]
    name = "tiny (make-checkpoint)" if width == "tiny" else f"released arch, width {width}"
    return (f"{name:<26}{t_pre * 1e3:>9.1f}ms{t_cold * 1e3:>8.1f}ms{t_miss * 1e3:>8.1f}ms{t_hit * 1e3:>8.2f}ms"
            f"{t_fp * 1e3:>10.1f}ms{t_cold / t_hit:>9.0f}x{(t_pre + t_cold) / (t_pre + t_hit):>7.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    ap.add_argument("--widths", default="tiny,64",
                    help="vision encoders: 'tiny' (make-checkpoint's) and/or base widths of the released "
                         "architecture (released: 256; default tiny,64)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    from PIL import Image

    from apertus_plugins.core.vocab import VocabSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(coarse).resize((args.size, args.size), Image.Resampling.BICUBIC).save(buf, "PNG")
    png = buf.getvalue()

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs visible, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}")
    from apertus_plugins.core.media import image

    shape = image.preprocess_image(image.decode_image(image.open_image(png))).pixels.shape
    print(f"image: {args.size}x{args.size} PNG -> pixels {list(shape)} float32, best of {args.repeat}")
    header = f"{'encoder':<26}{'preprocess':>11}{'cold':>10}{'miss':>10}{'hit':>10}{'fingerprint':>12}" \
             f"{'cold/hit':>10}{'total':>8}"
    print(header)
    image_codes = VocabSpec.scaled().modality("image").size
    with tempfile.TemporaryDirectory() as tmp:
        for width in [w.strip() for w in args.widths.split(",") if w.strip()]:
            print(_row(width, Path(tmp), png, image_codes, args.repeat))
    print("cold/hit: the encoder call alone; total: preprocess + encoder call (what a repeated image costs)")


if __name__ == "__main__":
    main()
