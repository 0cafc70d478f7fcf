#!/usr/bin/env python3
"""Quantized Apertus 1.5 and EAGLE-3 on one GPU: FP8, the report's 70B mix, an EAGLE-3 head.

The report (section 7.4) serves 8-bit FP8 weights and activations near-losslessly, finds NaN logits
with NVFP4 in the attention layers of the 8B (xIELU's quadratic term amplifying the quantization
noise), and fits the 70B into 49 GiB with FP8 attention and NVFP4 MLPs. This check serves, one after
the other, on one GPU::

    python benchmarks/gpu/vllm_quantized.py --checkpoint DIR_OR_ID [--mix DIR] [--eagle3 HEAD_DIR]
    python benchmarks/gpu/vllm_quantized.py --dry-run     # CPU: the setup only, on the tiny checkpoint

* ``bf16``: the checkpoint as released (the reference);
* ``fp8``: a W8A8 FP8 copy written here (``apertus_plugins.testing.quantize``: per-channel weight
  scales, dynamic per-token activations; embedding, head and encoders float32);
* ``mix``: ``--mix``, an FP8-attention/NVFP4-MLP checkpoint (the public one, or one made with
  ``llmcompressor`` from ``quantization_config("fp8-attn-nvfp4-mlp")``'s groups);
* ``eagle3``: the bf16 checkpoint with ``--eagle3`` as its EAGLE-3 head (a trained drafter, or a random
  one from ``apertus_plugins.testing.eagle3``): greedy tokens must equal ``bf16``'s.

Per variant: greedy tokens of a text and an image prompt (``--max-tokens``), whether any
log-probability is NaN, the tokens equal to ``bf16``'s before the first difference, decode tokens/s of
one request, and the server's start time. Writes ``$OUT/vllm_quantized.json`` (or ``--out``).
``--dry-run`` writes the FP8 copy of the tiny checkpoint, checks both quantization configs and
prints the commands it would run.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GPU_ARGS = ["--max-model-len", "8192", "--gpu-memory-utilization", "0.85", "--served-model-name", "apertus",
            "--tokenizer-mode", "auto", "--limit-mm-per-prompt", json.dumps({"image": 1, "audio": 0})]


def prompts() -> list[list[dict]]:
    from apertus_plugins.assets import __file__ as assets

    png = (Path(assets).parent / "demo.png").read_bytes()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    return [[{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
            [{"role": "user", "content": [image, {"type": "text", "text": "Describe the picture."}]}]]


def run_variant(name: str, model: str, extra: list[str], max_tokens: int) -> dict:
    from apertus_plugins.infra.client import http_json
    from apertus_plugins.testing.serve import VLLMServer

    t0 = time.perf_counter()
    with VLLMServer(model, args=[*GPU_ARGS, *extra], startup_timeout=1800) as srv:
        started = time.perf_counter() - t0
        out = []
        for messages in prompts():
            t1 = time.perf_counter()
            status, body = http_json(srv.url("/v1/chat/completions"), {
                "model": "apertus", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": True}, timeout=1800)
            if status != 200:
                out.append({"error": body})
                continue
            choice = body["choices"][0]
            lps = [s["logprob"] for s in choice["logprobs"]["content"]]
            out.append({"tokens": choice["token_ids"], "nan": any(math.isnan(v) for v in lps),
                        "tokens_per_s": max_tokens / (time.perf_counter() - t1)})
    return {"variant": name, "model": model, "start_s": started, "prompts": out}


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=os.environ.get("APERTUS_CHECKPOINT"))
    ap.add_argument("--mix", help="an FP8-attention / NVFP4-MLP checkpoint (the report's 70B mix)")
    ap.add_argument("--eagle3", help="an EAGLE-3 head (speculators format) for --checkpoint")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dry-run", action="store_true", help="CPU: build and check the setup, serve nothing")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "vllm_quantized.json"))
    args = ap.parse_args()

    from apertus_plugins.testing.quantize import quantization_config, write_quantized

    tmp = Path(tempfile.mkdtemp(prefix="apertus-quant-"))
    if args.dry_run:
        from apertus_plugins.testing.checkpoint import write_checkpoint

        args.checkpoint = str(write_checkpoint(tmp / "tiny"))
    if not args.checkpoint:
        ap.error("--checkpoint (or $APERTUS_CHECKPOINT) is required")
    from apertus_plugins.infra.hub import local_path

    base = local_path(args.checkpoint)
    fp8 = write_quantized(base, tmp / "fp8", "w8a8-fp8")
    mix = quantization_config("fp8-attn-nvfp4-mlp")
    plan = [("bf16", str(base), ["--dtype", "bfloat16"]), ("fp8", str(fp8), ["--dtype", "bfloat16"])]
    if args.mix:
        plan.append(("mix", args.mix, ["--dtype", "bfloat16"]))
    if args.eagle3:
        plan.append(("eagle3", str(base), ["--dtype", "bfloat16", "--speculative-config",
                                           json.dumps({"model": args.eagle3, "num_speculative_tokens": 3})]))
    if args.dry_run:
        cfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
        report = {"dry_run": True, "fp8_config": cfg, "mix_groups": mix["config_groups"],
                  "commands": [["vllm", "serve", m, *GPU_ARGS, *x] for _, m, x in plan], "ok": True}
    else:
        results = [run_variant(name, model, extra, args.max_tokens) for name, model, extra in plan]
        ref = results[0]["prompts"]
        for r in results:
            for p, want in zip(r["prompts"], ref, strict=True):
                if "tokens" in p and "tokens" in want:
                    p["agree_with_bf16"] = agreement(p["tokens"], want["tokens"])
        eagle_ok = all(p.get("tokens") == w.get("tokens") for r in results if r["variant"] == "eagle3"
                       for p, w in zip(r["prompts"], ref, strict=True))
        report = {"results": results, "ok": eagle_ok and not any(p.get("nan") or "error" in p for r in results
                                                                  if r["variant"] != "mix" for p in r["prompts"])}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2)[:4000])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
