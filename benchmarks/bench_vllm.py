"""Apertus 1.5 in vLLM: decode throughput against vLLM's built-in Apertus, and the tokenizer's share.

Run in the vllm environment (``python3 tools/dev.py run vllm python benchmarks/bench_vllm.py``).
In one run, on the same small random weights (``apertus_plugins.testing.checkpoint.write_checkpoint``):

1. Decode throughput of ``Apertus1p5ForConditionalGeneration`` (this plugin) and of vLLM's built-in
   ``ApertusForCausalLM``, and their ratio (target: at least 1.05). Both engines live side by side
   and are measured in alternation (text-only prompts, greedy, ``ignore_eos``). Decode only: for
   each engine, a batch generating 1 token and the same batch generating ``--max-tokens`` are
   timed, and the rate is ``prompts * (max_tokens - 1) / (t_max - t_1)``, so prompt processing and
   request overheads cancel (``t_1`` is the fastest 1-token batch of all rounds: a load spike in one
   short batch cannot inflate a rate); the best of ``--repeats`` rounds is printed, and the ratio is also the
   median of the rounds' paired ratios (each round times both engines back to back; on a shared
   machine the median is the number to read), and the median duration of the engines' decode steps
   (engine side, every step after a batch's prefill: the most robust of the three under a
   concurrent load) with their ratio. Both engines run in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that every round also times the parts of each engine
   step (:class:`StepTimers`) and prints where the time of a decoded token goes.
   The built-in model gets the
   same language-model weights in its own layout (``model.*`` from ``model.language_model.*``, the
   same ``lm_head``, the first ``output_vocab_size`` embedding rows: a text prompt uses no other),
   so both score the same text ids; the plugin keeps the full input embedding, embeds through the
   multimodal path and returns logits over the whole vocabulary (non-text ids at -inf).

   The breakdown (microseconds per decoded token, decode only: the same difference of a
   ``--max-tokens`` and a 1-token batch; the median of the rounds): ``inputs`` (the runner's input preparation and, for a
   multimodal model, its embedding of the ids and its media bookkeeping), ``decoder`` (the model's
   forward: embedding for a text-only model, layers, final norm), ``logits`` (``compute_logits``),
   ``sampler`` (vLLM's sampler), ``engine`` (the rest of the engine core's step: scheduler, output
   bookkeeping) and ``client`` (``LLM.generate`` outside the engine's steps: detokenization, outputs).
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


class StepTimers:
    """Wall-clock seconds spent in some methods of an in-process engine, per part of a decode step.

    :meth:`install` wraps the methods on their instances (the class keeps its own); ``totals()``
    reads the sums. Only for in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """

    PARTS = ("inputs", "decoder", "logits", "sampler", "engine")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys((*self.PARTS, "step"), 0.0)
        self.steps: list[float] = []  # the duration of every engine step, in order

    def _wrap(self, obj: object, attr: str, part: str) -> None:
        inner = getattr(obj, attr)
        seconds, steps = self.seconds, self.steps

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                seconds[part] += elapsed
                if part == "step":
                    steps.append(elapsed)

        setattr(obj, attr, timed)

    def install(self, llm) -> None:  # noqa: ANN001 (vllm.LLM)
        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        runner = core.model_executor.driver_worker.worker.model_runner
        self._wrap(core, "step_fn", "step")
        self._wrap(runner, "_prepare_inputs", "inputs")
        self._wrap(runner, "_preprocess", "inputs")
        self._wrap(runner, "_model_forward", "decoder")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner.sampler, "forward", "sampler")

    def totals(self) -> dict[str, float]:
        out = dict(self.seconds)
        out["engine"] = out.pop("step") - sum(out[p] for p in self.PARTS if p != "engine")
        return out


def timed_generate(llm, prompts: list[str], max_tokens: int) -> tuple[float, int]:  # noqa: ANN001
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_rates(engines: dict[str, object], prompts: list[str], max_tokens: int,
                 repeats: int) -> tuple[dict[str, float], list[float], dict[str, dict[str, float]], dict[str, float]]:
    """Decode-only rates of the engines, timed in ``repeats`` alternating rounds.

    A round times, for each engine in turn, a 1-token batch (``t1``) and a ``max_tokens`` batch
    (``tn``). A round's decode rate of an engine is ``tokens / (tn - min t1)``: the fastest 1-token
    batch of all rounds stands for the prompt processing and request overheads, so that a load spike
    in one short 1-token batch (on a shared machine) cannot inflate a rate. Returns the best rate
    (tokens/s) of each engine, each round's ratio of the first engine's rate to the second's, and
    per engine the median over the rounds of each part's microseconds per decoded token
    (:class:`StepTimers`; ``total`` is the whole decode time per token), and per engine the median
    duration (seconds) of its decode steps (every step of the ``max_tokens`` batches but their first,
    the prompts' prefill): the engine's work per decode step, robust to load spikes.
    """
    timers = {name: StepTimers() for name in engines}
    timed: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}  # (t1, tn, tokens)
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    decode_steps: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():
        timed_generate(llm, prompts, 8)  # warm-up
        timers[name].install(llm)
    for _ in range(repeats):
        for name, llm in engines.items():
            before = timers[name].totals()
            t1, n1 = timed_generate(llm, prompts, 1)
            one = timers[name].totals()
            first_step = len(timers[name].steps)
            tn, nn = timed_generate(llm, prompts, max_tokens)
            many = timers[name].totals()
            decode_steps[name] += timers[name].steps[first_step + 1:]
            tokens = nn - n1
            timed[name].append((t1, tn, tokens))
            # decode only: the max_tokens batch's time in each part less the 1-token batch's
            per = {part: 1e6 * ((many[part] - one[part]) - (one[part] - before[part])) / tokens
                   for part in StepTimers.PARTS}
            steps_n = sum(many.values()) - sum(one.values())
            steps_1 = sum(one.values()) - sum(before.values())
            per["client"] = 1e6 * ((tn - steps_n) - (t1 - steps_1)) / tokens
            per["total"] = 1e6 * (tn - t1) / tokens
            parts[name].append(per)
    rates = {}
    for name, rounds in timed.items():
        t1_min = min(t1 for t1, _, _ in rounds)
        rates[name] = [tokens / (tn - t1_min) for _, tn, tokens in rounds]
    first, second = rates.values()
    ratios = [a / b for a, b in zip(first, second, strict=True)]
    medians = {name: {part: sorted(r[part] for r in rounds)[len(rounds) // 2] for part in rounds[0]}
               for name, rounds in parts.items()}
    step_medians = {name: sorted(steps)[len(steps) // 2] for name, steps in decode_steps.items()}
    return {name: max(r) for name, r in rates.items()}, ratios, medians, step_medians


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
    p.add_argument("--repeats", type=int, default=15, help="alternating timing rounds per engine")
    p.add_argument("--image-requests", type=int, default=3, help="measured image requests (median printed; 0: decode only)")
    p.add_argument("--image-tokens", type=int, default=16, help="tokens generated per image request")
    p.add_argument("--threads", type=int, help="CPU threads of both engines, unbound (default: vLLM's binding, one "
                   "per core); 1 keeps a concurrent load from stalling OpenMP's thread team at every operation")
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
        engine_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engines in this process: their steps can be timed
        if args.threads:
            import torch

            engine_env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads))
            torch.set_num_threads(args.threads)
        saved = {name: os.environ.get(name) for name in engine_env}
        os.environ.update(engine_env)
        try:
            engines = {"plugin": make_engine(ckpt, args.prompts, args.dtype),
                       "builtin": make_engine(builtin, args.prompts, args.dtype)}
            rates, ratios, parts, steps = decode_rates(engines, prompts, args.max_tokens, args.repeats)
            for llm in engines.values():  # free the engines before the server starts
                llm.llm_engine.engine_core.shutdown()
            del engines
        finally:  # the image requests' server runs with the environment as it was
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        shares = (image_request_shares(ckpt, args.dtype, tmp / "codes.jsonl", args.image_requests, args.image_tokens)
                  if args.image_requests > 0 else [])

        size = args.size if not args.checkpoint and args.size in SIZES else "given"
        print("\n== Apertus 1.5 in vLLM (this machine) ==")
        print(f"weights: {size} (hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, "
              f"{text['num_attention_heads']} heads), dtype {args.dtype}; {args.prompts} text prompts decoded "
              f"together, {args.max_tokens} tokens each, best of {args.repeats} alternating rounds, "
              f"{f'{args.threads} thread(s), unbound' if args.threads else 'vLLM threads binding'}")
        print(f"decode throughput  Apertus1p5ForConditionalGeneration (plugin): {rates['plugin']:9.1f} tok/s")
        print(f"decode throughput  ApertusForCausalLM (vLLM built-in):          {rates['builtin']:9.1f} tok/s")
        print(f"ratio (plugin / built-in): best rates {rates['plugin'] / rates['builtin']:.3f}, median of the "
              f"rounds' ratios {sorted(ratios)[len(ratios) // 2]:.3f}  (target >= 1.05)")
        print("  rounds: " + ", ".join(f"{r:.3f}" for r in ratios))
        print(f"median decode step (engine side, {args.prompts} tokens): plugin {1e6 * steps['plugin']:.1f} us, "
              f"built-in {1e6 * steps['builtin']:.1f} us; ratio (built-in / plugin) "
              f"{steps['builtin'] / steps['plugin']:.3f}")
        print("where a decoded token's time goes (microseconds per token, the median of the rounds):")
        print(f"  {'part':<10}{'plugin':>10}{'built-in':>10}{'difference':>12}")
        for part in (*StepTimers.PARTS, "client", "total"):
            a, b = parts["plugin"][part], parts["builtin"][part]
            print(f"  {part:<10}{a:10.1f}{b:10.1f}{a - b:+12.1f}")
        if not shares:  # --image-requests 0: decode only
            return 0
        latency, encode = sorted(shares, key=lambda s: s[1] / s[0])[len(shares) // 2]  # the median share
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
