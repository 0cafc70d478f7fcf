"""Apertus 1.5 in vLLM: decode throughput against vLLM's built-in Apertus, and the tokenizer's share.

Run in the vllm environment (``python3 tools/dev.py run vllm python benchmarks/bench_vllm.py``).
In one run, on the same small random weights (``apertus_plugins.testing.checkpoint.write_checkpoint``):

1. Decode throughput of ``Apertus1p5ForConditionalGeneration`` (this plugin) and of vLLM's built-in
   ``ApertusForCausalLM``, and their ratio (target: at least 0.95). Both engines live side by side
   and are measured in alternation (text-only prompts, greedy, ``ignore_eos``). Decode only: for
   each engine, a batch generating 1 token and the same batch generating ``--max-tokens`` are
   timed, and the rate is ``prompts * (max_tokens - 1) / (t_max - t_1)``, so prompt processing and
   request overheads cancel; the best of ``--repeats`` rounds is kept. The built-in model gets the
   same language-model weights in its own layout (``model.*`` from ``model.language_model.*``, the
   same ``lm_head``, the first ``output_vocab_size`` embedding rows: a text prompt uses no other),
   so both score the same text ids; the plugin keeps the full input embedding, embeds through the
   multimodal path and returns logits over the whole vocabulary (non-text ids at -inf).
2. For one chat request with one 512x512 image (``--image-tokens`` generated tokens), the share of
   its latency (client side, HTTP included) spent in the vision tokenizer, as the model itself
   times the encoder (``APERTUS_VLLM_CODES_LOG``). Each measured request carries an image the server
   has not seen (vLLM caches processed media and encoder outputs by content); the request with the
   median share of ``--image-requests`` is printed, after one warm-up request with yet another image.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def convert_to_builtin(src: Path, dst: Path) -> Path:
    """The language model of an Apertus 1.5 checkpoint as a vLLM ``ApertusForCausalLM`` checkpoint."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    text = dict(cfg["text_config"])
    rows = text.get("output_vocab_size") or text["vocab_size"]
    weights = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in weights.items():
        if name.startswith("model.language_model."):
            new = "model." + name[len("model.language_model."):]
            out[new] = t[:rows].contiguous() if new == "model.embed_tokens.weight" else t
        elif name == "lm_head.weight":
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text.update({"architectures": ["ApertusForCausalLM"], "model_type": "apertus", "vocab_size": rows,
                 "dtype": cfg.get("dtype", "float32")})
    text.pop("output_vocab_size", None)
    (dst / "config.json").write_text(json.dumps(text, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, dst / f.name)
    return dst


def make_engine(model_dir: Path, prompts: int, dtype: str):  # noqa: ANN201 (vllm.LLM)
    from vllm import LLM

    multimodal = "Apertus1p5" in (model_dir / "config.json").read_text()
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=2048, enforce_eager=True,
               gpu_memory_utilization=0.5, max_num_seqs=prompts, enable_prefix_caching=False,
               limit_mm_per_prompt={"image": 0, "audio": 0} if multimodal else None)


def timed_generate(llm, prompts: list[str], max_tokens: int) -> tuple[float, int]:  # noqa: ANN001
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_rates(engines: dict[str, object], prompts: list[str], max_tokens: int, repeats: int) -> dict[str, float]:
    """Best decode-only rate (tokens/s) per engine over ``repeats`` alternating rounds."""
    best = dict.fromkeys(engines, 0.0)
    for llm in engines.values():  # warm-up
        timed_generate(llm, prompts, 8)
    for _ in range(repeats):
        for name, llm in engines.items():
            t1, n1 = timed_generate(llm, prompts, 1)
            tn, nn = timed_generate(llm, prompts, max_tokens)
            if tn > t1:
                best[name] = max(best[name], (nn - n1) / (tn - t1))
    return best


def random_png(seed: int, side: int = 512) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_request_shares(model_dir: Path, dtype: str, codes_log: Path, requests: int,
                         max_tokens: int) -> list[tuple[float, float]]:
    """(request latency, seconds in the vision tokenizer) for ``requests`` requests, each with a new 512x512 image."""
    from apertus_plugins.infra.client import http_json
    from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

    out = []
    args = [*CPU_ARGS, "--dtype", dtype, "--served-model-name", "apertus"]
    with VLLMServer(model_dir, args=args, env={"APERTUS_VLLM_CODES_LOG": str(codes_log)}) as srv:
        for i in range(requests + 1):
            url = random_png(seed=1000 + i)
            codes_log.write_text("")
            start = time.perf_counter()
            status, body = http_json(srv.url("/v1/chat/completions"), {
                "model": "apertus", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]},
                timeout=600)
            latency = time.perf_counter() - start
            if status != 200:
                raise RuntimeError(f"the image request failed: {status} {body}")
            entries = [json.loads(line) for line in codes_log.read_text().splitlines()]
            if [e["modality"] for e in entries] != ["image"]:
                raise RuntimeError(f"expected one encoded image for request {i}, the model logged {entries!r:.300}")
            if i:  # the first request warms the server up
                out.append((latency, float(entries[0]["seconds"])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="language model size of the random checkpoint (tiny, small)")
    p.add_argument("--prompts", type=int, default=4, help="text prompts decoded together")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt in the decode timing")
    p.add_argument("--repeats", type=int, default=3, help="alternating timing rounds per engine")
    p.add_argument("--image-requests", type=int, default=3, help="measured image requests (median printed)")
    p.add_argument("--image-tokens", type=int, default=16, help="tokens generated per image request")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--checkpoint", help="an Apertus 1.5 checkpoint directory (default: a small random one)")
    args = p.parse_args()

    from apertus_plugins.testing.checkpoint import SIZES, write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="apertus-bench-"))
    try:
        ckpt = Path(args.checkpoint) if args.checkpoint else write_checkpoint(tmp / "apertus1p5", size=args.size)
        text = json.loads((ckpt / "config.json").read_text())["text_config"]
        builtin = convert_to_builtin(ckpt, tmp / "apertus-builtin")
        prompts = [f"Prompt number {i}: tell me about the Swiss AI Initiative." for i in range(args.prompts)]
        engines = {"plugin": make_engine(ckpt, args.prompts, args.dtype),
                   "builtin": make_engine(builtin, args.prompts, args.dtype)}
        rates = decode_rates(engines, prompts, args.max_tokens, args.repeats)
        for llm in engines.values():  # stop the engine processes before the server starts
            llm.llm_engine.engine_core.shutdown()
        del engines
        shares = image_request_shares(ckpt, args.dtype, tmp / "codes.jsonl", args.image_requests, args.image_tokens)

        size = args.size if not args.checkpoint and args.size in SIZES else "given"
        latency, encode = sorted(shares, key=lambda s: s[1] / s[0])[len(shares) // 2]  # the median share
        print("\n== Apertus 1.5 in vLLM (this machine) ==")
        print(f"weights: {size} (hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, "
              f"{text['num_attention_heads']} heads), dtype {args.dtype}; {args.prompts} text prompts decoded "
              f"together, {args.max_tokens} tokens each, best of {args.repeats} alternating rounds")
        print(f"decode throughput  Apertus1p5ForConditionalGeneration (plugin): {rates['plugin']:9.1f} tok/s")
        print(f"decode throughput  ApertusForCausalLM (vLLM built-in):          {rates['builtin']:9.1f} tok/s")
        print(f"ratio (plugin / built-in): {rates['plugin'] / rates['builtin']:.3f}  (target >= 0.95)")
        print(f"one 512x512 image ({args.image_tokens} tokens generated), the median of {len(shares)} requests: "
              f"latency {latency:.3f} s, vision tokenizer {encode:.3f} s = {100 * encode / latency:.1f}% of the "
              "request")
        for i, (lat, enc) in enumerate(shares):
            print(f"  request {i + 1}: latency {lat:.3f} s, vision tokenizer {enc:.3f} s ({100 * enc / lat:.1f}%)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
