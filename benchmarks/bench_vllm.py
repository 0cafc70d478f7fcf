"""Apertus 1.5 in vLLM: decode throughput against vLLM's built-in Apertus, and the tokenizer's share.

Run in the vllm environment (``python3 tools/dev.py run vllm python benchmarks/bench_vllm.py``).
In one run, on the same small random weights:

1. decode throughput (generated tokens per second, text-only prompts, greedy, ``ignore_eos``) of
   ``Apertus1p5ForConditionalGeneration`` (this plugin) and of vLLM's built-in
   ``ApertusForCausalLM``, and their ratio (target: at least 0.95). The built-in model gets the
   same language-model weights in its own layout: ``model.*`` from ``model.language_model.*``, the
   same ``lm_head``, and the first ``output_vocab_size`` embedding rows (a text-only prompt uses no
   other), so it scores the same text ids; the plugin additionally keeps the full input embedding
   and returns logits over the whole vocabulary (non-text ids at -inf).
2. for one request with one 512x512 image, the share of its latency spent in the vision tokenizer
   (the encoder time the model logs through ``APERTUS_VLLM_CODES_LOG``).
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def decode_throughput(model_dir: Path, prompts: list[str], max_tokens: int, dtype: str) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=2048, enforce_eager=True,
              gpu_memory_utilization=0.5, max_num_seqs=len(prompts), limit_mm_per_prompt={"image": 0, "audio": 0}
              if "Apertus1p5" in (model_dir / "config.json").read_text() else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    del llm
    gc.collect()
    return best


def image_request_share(model_dir: Path, dtype: str, codes_log: Path) -> tuple[float, float]:
    """(request latency, seconds in the vision tokenizer) for one 512x512 image, 16 generated tokens."""
    import numpy as np
    from PIL import Image

    from apertus_plugins.serve import CPU_ARGS, VLLMServer, http_json

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (512, 512, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with VLLMServer(model_dir, args=[*CPU_ARGS, "--dtype", dtype], env={"APERTUS_VLLM_CODES_LOG": str(codes_log)}) as srv:
        def ask(text: str) -> float:
            t = time.perf_counter()
            status, body = http_json(srv.url("/v1/chat/completions"), {
                "model": str(model_dir), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]},
                timeout=600)
            assert status == 200, body
            return time.perf_counter() - t

        ask("warm-up ")
        codes_log.write_text("")
        latency = ask("What is this? ")  # a different prompt; the image is encoded again (new text, same media
        # hash would hit the encoder cache, so a second image variant is not needed: the log tells)
        entries = [json.loads(line) for line in codes_log.read_text().splitlines()]
    return latency, sum(e.get("seconds", 0.0) for e in entries)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--checkpoint", help="an Apertus 1.5 checkpoint (default: a small random one)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    tmp = Path(tempfile.mkdtemp(prefix="apertus-bench-"))
    try:
        if args.checkpoint:
            ckpt = Path(args.checkpoint)
        else:
            from _checkpoint import write_checkpoint

            ckpt = write_checkpoint(tmp / "apertus1p5", hidden=args.hidden, layers=args.layers,
                                    heads=args.hidden // 64, intermediate=4 * args.hidden)
        builtin = convert_to_builtin(ckpt, tmp / "apertus-builtin")
        prompts = [f"Prompt number {i}: tell me about the Swiss AI Initiative." for i in range(args.prompts)]
        ours = decode_throughput(ckpt, prompts, args.max_tokens, args.dtype)
        base = decode_throughput(builtin, prompts, args.max_tokens, args.dtype)
        latency, encode = image_request_share(ckpt, args.dtype, tmp / "codes.jsonl")
        print("\n== Apertus 1.5 in vLLM (this machine, CPU) ==")
        print(f"weights: hidden {args.hidden}, {args.layers} layers, dtype {args.dtype}; "
              f"{args.prompts} text prompts x {args.max_tokens} tokens")
        print(f"decode throughput  Apertus1p5ForConditionalGeneration: {ours:9.1f} tok/s")
        print(f"decode throughput  ApertusForCausalLM (built-in):      {base:9.1f} tok/s")
        print(f"ratio (plugin / built-in): {ours / base:.3f}  (target >= 0.95)")
        print(f"one 512x512 image, 16 tokens: latency {latency:.3f} s, vision tokenizer {encode:.3f} s "
              f"= {100 * encode / latency:.1f}% of the request")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
