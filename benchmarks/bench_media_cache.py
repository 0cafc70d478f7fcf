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

``--serve`` (run it in the vllm environment: ``python3 tools/dev.py run vllm python
benchmarks/bench_media_cache.py --serve``) measures chat requests instead, on the tiny checkpoint, against
one server with the media-code cache and vLLM's prefix cache on: ``--requests`` cold requests (each a
new 512x512 image: encoded and stored), then ``--requests`` rounds of, side by side, the first image
again (stored: it reaches the engine as token ids, ``vllm_model.known_media``, found through the
raw-bytes index without being decoded), the same image found by its pixels (decoded, preprocessed and
hashed: the request sets its own image decoder options, ``media_io_kwargs``, which the index is not
written for; the path before the index), the same image on the multimodal path (``media_as_text:
false``) and a text prompt of the same length (repeated, as the image is). It prints the median
latencies, the ratios to text (the issue's target for a repeated image: within 1.1x) and a cold
image's cost broken down: decode and preprocess (measured here, on the same PNG), the encoder
(``APERTUS_VLLM_CODES_LOG``'s seconds) and the rest.
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


def _png_url(seed: int, side: int) -> str:
    import base64

    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(srv, content, max_tokens: int, as_text: bool = True,  # noqa: ANN001 (VLLMServer)
          index: bool = True) -> tuple[float, int]:
    from apertus_plugins.infra.client import http_json

    payload = {"model": "apertus", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               "messages": [{"role": "user", "content": content}]}
    if not as_text:
        payload["mm_processor_kwargs"] = {"media_as_text": False}
    if not index:  # the decoder's own options (vLLM's defaults, spelled out): the raw-bytes index is skipped
        payload["media_io_kwargs"] = {"image": {"image_mode": "RGB"}}
    t0 = time.perf_counter()
    status, body = http_json(srv.url("/v1/chat/completions"), payload, timeout=600)
    if status != 200:
        raise RuntimeError(f"request failed: {status} {body!r:.300}")
    return time.perf_counter() - t0, int(body["usage"]["prompt_tokens"])


def _text_of(srv, tokens: int, salt: int) -> str:  # noqa: ANN001
    """A text prompt whose chat request has ``tokens`` prompt tokens (found through /tokenize)."""
    from apertus_plugins.infra.client import http_json

    def count(text: str) -> int:
        status, body = http_json(srv.url("/tokenize"), {"model": "apertus",
                                                        "messages": [{"role": "user", "content": text}]})
        if status != 200:
            raise RuntimeError(f"/tokenize failed: {status} {body!r:.300}")
        return int(body["count"])

    words = [f"w{salt}x{i}" for i in range(tokens)]
    lo, hi = 1, tokens
    while lo < hi:  # the fewest words reaching the length
        mid = (lo + hi) // 2
        if count(" ".join(words[:mid])) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def serve(args: argparse.Namespace) -> None:
    """One server with the media-code cache and vLLM's prefix cache on; see the module docstring."""
    import json
    import statistics

    from apertus_plugins.core.media import image
    from apertus_plugins.testing.checkpoint import write_checkpoint
    from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

    flags = [*CPU_ARGS, "--dtype", "float32", "--served-model-name", "apertus", "--enable-prefix-caching",
             "--trust-request-mm-kwargs"]
    urls = [_png_url(100 + i, args.size) for i in range(args.requests + 2)]

    def part(url: str) -> list:
        return [{"type": "text", "text": "What is this? "}, {"type": "image_url", "image_url": {"url": url}}]

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ck")
        cache, log = Path(tmp) / "codes", Path(tmp) / "codes.jsonl"
        env = {"APERTUS_MEDIA_CACHE": str(cache), "APERTUS_VLLM_CODES_LOG": str(log)}
        with VLLMServer(ckpt, args=flags, env=env, log_path=Path(tmp) / "vllm.log") as srv:
            deadline = time.monotonic() + 120
            while "reach the engine as token ids" not in srv.log_path.read_text(errors="replace"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the renderer did not take the encoder's fingerprint:\n" + srv.log_tail())
                time.sleep(0.5)
            _chat(srv, "warm up", args.max_tokens)
            _chat(srv, part(urls[-1]), args.max_tokens)  # warms the multimodal path up
            cold = [_chat(srv, part(u), args.max_tokens) for u in urls[:args.requests]]
            encoder = [json.loads(line)["seconds"] for line in log.read_text().splitlines()]
            tokens = cold[0][1]
            text = _text_of(srv, tokens, 0)
            rounds: dict[str, list[tuple[float, int]]] = {"as text": [], "by pixels": [], "multimodal": [], "text": []}
            for _ in range(args.requests):  # side by side: one of each per round
                rounds["as text"].append(_chat(srv, part(urls[0]), args.max_tokens))
                rounds["by pixels"].append(_chat(srv, part(urls[0]), args.max_tokens, index=False))
                rounds["multimodal"].append(_chat(srv, part(urls[0]), args.max_tokens, as_text=False))
                rounds["text"].append(_chat(srv, text, args.max_tokens))
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(np.random.default_rng(100).integers(0, 256, (16, 16, 3), dtype=np.uint8)).resize(
        (args.size, args.size), Image.Resampling.BICUBIC).save(png, "PNG")
    t_pre, _ = _best(lambda: image.preprocess_image(image.decode_image(image.open_image(png.getvalue()))), 5)
    med = {k: statistics.median(t for t, _ in v) for k, v in (("cold", cold), *rounds.items())}
    enc = statistics.median(encoder[-args.requests:]) if encoder else float("nan")
    print(json.dumps({"requests": args.requests, "image": f"{args.size}x{args.size}", "prompt_tokens": tokens,
                      "text_prompt_tokens": rounds["text"][0][1], "max_tokens": args.max_tokens,
                      "items_encoded": len(encoder)}))
    print(f"median latency, side by side: repeated image as text {med['as text'] * 1e3:.0f} ms (raw-bytes index), "
          f"{med['by pixels'] * 1e3:.0f} ms (found by its pixels: decoded, preprocessed, hashed), on the multimodal "
          f"path {med['multimodal'] * 1e3:.0f} ms, text of the same length {med['text'] * 1e3:.0f} ms")
    print(f"repeated image / text: as text {med['as text'] / med['text']:.2f}x (target <= 1.1), by pixels "
          f"{med['by pixels'] / med['text']:.2f}x, multimodal path {med['multimodal'] / med['text']:.2f}x")
    rest = med["cold"] - t_pre - enc
    print(f"cold image {med['cold'] * 1e3:.0f} ms ({med['cold'] / med['text']:.2f}x text): decode+preprocess "
          f"{t_pre * 1e3:.0f} ms, encoder {enc * 1e3:.0f} ms, the rest (request, processor, prefill, decode) "
          f"{rest * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    ap.add_argument("--widths", default="tiny,64",
                    help="vision encoders: 'tiny' (make-checkpoint's) and/or base widths of the released "
                         "architecture (released: 256; default tiny,64)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--serve", action="store_true", help="measure chat requests against two vLLM servers instead")
    ap.add_argument("--requests", type=int, default=5, help="--serve: measured requests of each kind")
    ap.add_argument("--max-tokens", type=int, default=4, help="--serve: tokens generated per request")
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return

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
