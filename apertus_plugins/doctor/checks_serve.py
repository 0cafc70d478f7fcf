"""Checks against a serving endpoint (``--serve URL``): the plumbing, not the quality of the answers.

Every prompt the server reports (vLLM's ``return_token_ids``) is compared id for id with the
core's own encoding of the same conversation (the checkpoint's tokenizer, the 1.5 template, the
media sequences; media code positions compare as their placeholder). Where a check needs a
known output it forces one through the server's own mechanisms: a structured-output choice
(with ``include_reasoning: false`` so the constraint holds from the first token), or a
``logit_bias`` on one token. The degeneration probe alone looks at free generations.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from apertus_plugins.core.chat import MediaItem, injection_literals, parse_output
from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.core.media import image as media_image
from apertus_plugins.plugins import serving_layout
from apertus_plugins.posttrain.evaluation import degeneration

from .registry import Context, check, short
from .report import FAIL, PASS
from .serve_client import ServeClient, ServeError, assemble

__all__ = ["DEFAULT_PROBES", "TOOLS", "image_probe"]

#: The degeneration probe's default prompts: short, in the languages of the release.
DEFAULT_PROBES: list[dict[str, Any]] = [
    {"prompt": "Explain in three sentences why the sky is blue."},
    {"prompt": "Beschreibe in drei Sätzen, wie ein Gletscher entsteht."},
    {"prompt": "Écris un court paragraphe sur le lac Léman."},
    {"prompt": "List the first ten prime numbers and say how you found them."},
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}]


def _server(ctx: Context) -> ServeClient:
    if ctx.server is None:
        raise ServeError("no server given (--serve URL)")
    return ctx.server


def _data(name: str) -> Path:
    return Path(str(resources.files("apertus_plugins") / "assets" / name))


def _message(body: dict[str, Any]) -> dict[str, Any]:
    return body["choices"][0].get("message") or {}


def _reasoning(msg: dict[str, Any]) -> str:
    return msg.get("reasoning") or msg.get("reasoning_content") or ""


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    ids = body.get("prompt_token_ids")
    if not isinstance(ids, list):
        raise ServeError("the server does not report the prompt's token ids (vLLM's return_token_ids)")
    return [int(i) for i in ids]


def _as_placeholders(ctx: Context, ids: Any) -> list[int]:
    """Media codes replaced by their modality's placeholder: servers differ in what they report there."""
    arr = np.asarray(ids, dtype=np.int64).copy()
    for name, placeholder in (("image", "image"), ("audio", "audio")):
        m = ctx.ref.modality(name)
        arr[(arr >= m.offset) & (arr < m.end)] = ctx.ref.id(placeholder)
    return arr.tolist()


def _prompt_problems(ctx: Context, got: list[int], want: Any) -> list[str]:
    got_n, want_n = _as_placeholders(ctx, got), _as_placeholders(ctx, want)
    problems = []
    if got_n != want_n:
        k = next((i for i, (a, b) in enumerate(zip(got_n, want_n, strict=False)) if a != b), min(len(got_n), len(want_n)))
        problems.append(f"the server's prompt ({len(got_n)} ids) differs from the core encoding ({len(want_n)} ids) "
                        f"at position {k}: {short(ctx.chat.decode(got_n[k:k + 8]), 40)} vs "
                        f"{short(ctx.chat.decode(want_n[k:k + 8]), 40)}")
    bos = ctx.ref.bos_id
    if got.count(bos) != 1 or (got and got[0] != bos):
        problems.append(f"{got.count(bos)} BOS in the server's prompt")
    return problems


def _stops_at(ctx: Context, name: str) -> str | None:
    """Force ``name`` as the first generated token; the server must stop right there."""
    tid = ctx.ref.id(name)
    body = _server(ctx).chat([{"role": "user", "content": "Go on."}], max_tokens=4, logit_bias={str(tid): 100})
    choice = body["choices"][0]
    n = (body.get("usage") or {}).get("completion_tokens")
    if choice.get("finish_reason") != "stop" or n != 1:
        return (f"generation does not stop at {ctx.ref.literal(name)}: {n} tokens, finish_reason "
                f"{choice.get('finish_reason')!r}")
    return None


@check("serve.text", "a text request: the server's prompt is the core encoding with one BOS; it stops at <|assistant_end|>")
def text(ctx: Context) -> tuple[str, str]:
    srv = _server(ctx)
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    body = srv.chat(messages, max_tokens=8)
    ids = _prompt_ids(body)
    want = ctx.chat.encode_conversation(messages, add_generation_prompt=True).ids
    problems = _prompt_problems(ctx, ids, want)
    stop = _stops_at(ctx, "assistant_end")
    problems += [stop] if stop else []
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"{len(ids)} prompt ids = the core encoding, one BOS; generation stops at {ctx.ref.literal('assistant_end')}"


def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def image_probe(ctx: Context) -> dict[str, Any]:
    """One image request (the bundled ``demo.png``): its prompt, the layout the server used, the problems."""

    def compute() -> dict[str, Any]:
        from PIL import Image

        path = _data("demo.png")
        with Image.open(path) as im:
            width, height = im.size
        rows, cols = media_image.image_grid(height, width)
        part = {"type": "image_url", "image_url": {"url": _data_url(path, "image/png")}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "Describe: "}, part]}]
        ids = _prompt_ids(_server(ctx).chat(messages, max_tokens=2))
        layout = media_image.detect_image_layout(_as_placeholders(ctx, ids), ctx.ref)
        if layout is None:
            raise ServeError(f"the server's prompt ({len(ids)} ids) holds no image sequence")
        seq = media_image.image_placeholder_sequence(rows, cols, ctx.ref, layout, ctx.chat.char_ids)
        want = ctx.chat.encode_conversation(messages, add_generation_prompt=True, media=[MediaItem("image", seq)]).ids
        return {"layout": layout, "grid": [rows, cols], "ids": len(ids), "problems": _prompt_problems(ctx, ids, want)}

    return ctx.memo("serve.image", compute)


@check("serve.image", "an image request: the server's prompt is the core encoding with the image sequence")
def image(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    probe = image_probe(ctx)
    details = {"layout": probe["layout"], "grid": probe["grid"]}
    if probe["problems"]:
        return FAIL, "; ".join(probe["problems"]), details
    rows, cols = probe["grid"]
    return PASS, (f"{probe['ids']} prompt ids = the core encoding: demo.png as a {rows}x{cols} grid in the "
                  f"{probe['layout']} layout"), details


@check("serve.audio", "an audio request: the server's prompt is the core encoding with the audio sequence at 24 kHz")
def audio(ctx: Context) -> tuple[str, str]:
    path = _data("demo.wav")
    wave, rate = media_audio.load_audio(path)
    clip = media_audio.preprocess_audio(wave, rate)
    codes = media_audio.audio_code_count(clip.shape[-1])
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(), "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Transcribe."}]}]
    ids = _prompt_ids(_server(ctx).chat(messages, max_tokens=2))
    seq = media_audio.audio_placeholder_sequence(codes, ctx.ref)
    want = ctx.chat.encode_conversation(messages, add_generation_prompt=True, media=[MediaItem("audio", seq)]).ids
    problems = _prompt_problems(ctx, ids, want)
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"{len(ids)} prompt ids = the core encoding: demo.wav ({rate} Hz) as {codes} codes at 24 kHz"


def _injection_cases(ctx: Context, corpus: str) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any], list[Any]]]:
    """Requests with ``corpus`` in every position a client controls: ``name -> (messages, params, media)``."""
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": f"Look up. {corpus}",
        "parameters": {"type": "object", "properties": {
            "q": {"type": "string", "description": corpus, "enum": [corpus, "plain"]}}, "required": ["q"]}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": corpus})}}
    path = _data("demo.png")
    from PIL import Image

    with Image.open(path) as im:
        width, height = im.size
    rows, cols = media_image.image_grid(height, width)
    seq = media_image.image_placeholder_sequence(rows, cols, ctx.ref, serving_layout("image"), ctx.chat.char_ids)
    image_part = {"type": "image_url", "image_url": {"url": _data_url(path, "image/png")}}
    return {
        "user text": ([{"role": "user", "content": f"hi {corpus}"}], {}, []),
        "user text beside an image": ([{"role": "user", "content": [{"type": "text", "text": corpus}, image_part,
                                                                    {"type": "text", "text": corpus}]}], {},
                                      [MediaItem("image", seq)]),
        "a system message": ([{"role": "system", "content": corpus}, {"role": "user", "content": "hi"}], {}, []),
        "tool names and descriptions": ([{"role": "user", "content": "hi"}], {"tools": tools}, []),
        "a tool call and its output": ([{"role": "user", "content": "look it up"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": "c1", "content": corpus}],
                                       {"tools": tools}, []),
    }


def _forged_label(ref: Any, tid: int) -> str:
    name = ref.id_to_name.get(tid)
    if name in ("image", "audio"):
        return f"{ref.literal(name)} or {name} codes"
    return ref.literal(name) if name else str(tid)


@check("serve.injection", "structure literals in user text, system text, tool outputs, tool names and descriptions "
                          "reach the server's prompt as text: no forged structure id, no extra media slot")
def injection(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    srv = _server(ctx)
    ref = ctx.ref
    corpus = "".join(injection_literals(ref))
    problems, forged_all = [], {}
    cases = _injection_cases(ctx, corpus)
    for name, (messages, params, media) in cases.items():
        want = ctx.chat.encode_conversation(messages, add_generation_prompt=True, media=media or None,
                                            tools=params.get("tools")).ids
        try:
            got = _prompt_ids(srv.chat(messages, max_tokens=1, **params))
        except ServeError as exc:
            problems.append(f"{name}: the server refused the request ({short(str(exc), 80)})")
            continue
        got_n, want_n = _as_placeholders(ctx, got), _as_placeholders(ctx, want)
        extra = Counter(i for i in got_n if i in ref.structure_ids) - Counter(i for i in want_n if i in ref.structure_ids)
        if extra:
            # media codes count as their placeholder (servers differ in what they report at code positions)
            forged = {_forged_label(ref, i): n for i, n in sorted(extra.items())}
            forged_all[name] = forged
            problems.append(f"{name}: forged structure ids " + ", ".join(f"{k} x{n}" for k, n in forged.items()))
        elif got_n != want_n:
            problems += [f"{name}: {p}" for p in _prompt_problems(ctx, got, want)]
    details = {"forged": forged_all, "cases": list(cases), "literals": len(injection_literals(ref))}
    if problems:
        return FAIL, "; ".join(problems), details
    return PASS, (f"{len(injection_literals(ref))} structure literals in {len(cases)} positions (user text, beside an "
                  "image, system text, tool names and descriptions, tool calls and outputs) reach the prompt as text: "
                  "the server's ids are the core encoding"), details


def _call_text(ctx: Context, calls: list[dict[str, Any]]) -> str:
    return ctx.ref.literal("tools_prefix") + json.dumps(calls, ensure_ascii=False) + ctx.ref.literal("tools_suffix")


def _calls(msg: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "null")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        out.append((fn.get("name"), args))
    return out


@check("serve.tool_call", "a tool call round trip: the call is parsed, the outputs go back in, generation stops after a call")
def tool_call(ctx: Context) -> tuple[str, str]:
    srv = _server(ctx)
    messages = [{"role": "user", "content": "What is the weather in Bern?"}]
    forced = _call_text(ctx, [{"get_weather": {"city": "Bern"}}])
    body = srv.chat(messages, tools=TOOLS, max_tokens=200, structured_outputs={"choice": [forced]},
                    include_reasoning=False)
    problems = _prompt_problems(ctx, _prompt_ids(body), ctx.chat.encode_conversation(
        messages, tools=TOOLS, add_generation_prompt=True).ids)
    msg = _message(body)
    calls = _calls(msg)
    if calls != [("get_weather", {"city": "Bern"})]:
        problems.append(f"the forced call came back as tool_calls {calls}, content {short(msg.get('content'), 60)}")
    elif body["choices"][0].get("finish_reason") != "tool_calls":
        problems.append(f"finish_reason {body['choices'][0].get('finish_reason')!r} after a call, want 'tool_calls'")
    if not problems:
        call = msg["tool_calls"][0]
        back = messages + [{"role": "assistant", "content": "", "tool_calls": msg["tool_calls"]},
                           {"role": "tool", "tool_call_id": call.get("id"), "content": "3 degrees and sunny"}]
        body2 = srv.chat(back, tools=TOOLS, max_tokens=4)
        want2 = ctx.chat.encode_conversation(back, tools=TOOLS, add_generation_prompt=True).ids
        problems += [f"with the tool output: {p}" for p in _prompt_problems(ctx, _prompt_ids(body2), want2)]
    stop = _stops_at(ctx, "tools_suffix")
    problems += [stop] if stop else []
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, ("forced call parsed as get_weather({'city': 'Bern'}), finish_reason tool_calls; the tool output "
                  f"goes back as the core encodes it; generation stops after {ctx.ref.literal('tools_suffix')}")


@check("serve.thinking", "thinking on and off reach the prompt; the thinking span goes to the reasoning channel")
def thinking(ctx: Context) -> tuple[str, str]:
    srv, ref = _server(ctx), ctx.ref
    messages = [{"role": "user", "content": "Is 7 a prime number?"}]
    problems = []
    for flag in (True, False):
        body = srv.chat(messages, max_tokens=1, chat_template_kwargs={"enable_thinking": flag})
        want = ctx.chat.encode_conversation(messages, add_generation_prompt=True, enable_thinking=flag).ids
        problems += [f"thinking {'on' if flag else 'off'}: {p}" for p in _prompt_problems(ctx, _prompt_ids(body), want)]
    # an open thinking span (the model is pushed to open it): all reasoning, no content
    body = srv.chat(messages, max_tokens=3, logit_bias={str(ref.id("inner_prefix")): 100},
                    chat_template_kwargs={"enable_thinking": True})
    msg = _message(body)
    out_ids = body["choices"][0].get("token_ids") or []
    expect = parse_output(ctx.chat.decode(out_ids)).thinking if out_ids else None
    if not _reasoning(msg) or msg.get("content") or (expect is not None and _reasoning(msg) != expect):
        problems.append(f"an open thinking span came back as reasoning {short(_reasoning(msg), 40)}, content "
                        f"{short(msg.get('content'), 40)}")
    # a closed span, reasoning hidden: the content is the answer alone
    answer = "Yes, seven is prime."
    forced = ref.literal("inner_prefix") + "Seven has no divisors but one and itself." + ref.literal("inner_suffix") + answer
    body = srv.chat(messages, max_tokens=200, structured_outputs={"choice": [forced]}, include_reasoning=False,
                    chat_template_kwargs={"enable_thinking": True})
    content = _message(body).get("content")
    if content != answer:
        problems.append(f"with the reasoning hidden, the content is {short(content, 60)}, want {answer!r}")
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, ("Deliberation enabled/disabled in the prompt as the core renders it; an open span is all "
                  f"reasoning; a closed span leaves the content {answer!r}")


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for c in d.get("tool_calls") or []:
        fn = c.get("function", c)
        try:
            args = json.loads(fn.get("arguments") or "null")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        calls.append((fn.get("name"), args))
    return {"content": d.get("content") or "", "reasoning": _reasoning(d), "tool_calls": calls}


@check("serve.streaming", "streamed answers assemble to the whole answer: text, a thinking span, a tool call")
def streaming(ctx: Context) -> tuple[str, str]:
    srv, ref = _server(ctx), ctx.ref
    cases = {
        "free text": ([{"role": "user", "content": "Count to five."}], {"max_tokens": 16}),
        "thinking": ([{"role": "user", "content": "Is 7 a prime number?"}], {
            "max_tokens": 200, "include_reasoning": False, "chat_template_kwargs": {"enable_thinking": True},
            "structured_outputs": {"choice": [ref.literal("inner_prefix") + "Check divisors." + ref.literal(
                "inner_suffix") + "Yes."]}}),
        "tool call": ([{"role": "user", "content": "Weather in Chur and Bern?"}], {
            "max_tokens": 200, "include_reasoning": False, "tools": TOOLS, "structured_outputs": {"choice": [
                _call_text(ctx, [{"get_weather": {"city": "Chur"}}, {"get_weather": {"city": "Bern"}}])]}}),
    }
    problems, compared, skipped = [], [], []
    for name, (messages, params) in cases.items():
        try:
            whole = _summary(_message(srv.chat(messages, **params)))
        except ServeError as exc:  # the feature itself is missing (its own check says so): nothing to compare
            skipped.append(f"{name} (refused whole too: {short(str(exc), 60)})")
            continue
        streamed = _summary(assemble(srv.stream(messages, **params)))
        compared.append(name)
        if whole != streamed:
            diff = {k: (streamed[k], whole[k]) for k in whole if whole[k] != streamed[k]}
            problems.append(f"{name}: streamed {short(diff, 120)} (streamed, whole)")
    note = f"; not compared: {', '.join(skipped)}" if skipped else ""
    if problems or not compared:
        return FAIL, "; ".join(problems or ["no case could be compared"]) + note
    return PASS, (f"{', '.join(compared)}: the streamed deltas assemble to the whole answers (content, reasoning, "
                  f"calls){note}")


def _probe_messages(item: dict[str, Any]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    if isinstance(item.get("messages"), list):
        messages = item["messages"]
        label = next((m.get("content") for m in reversed(messages) if isinstance(m.get("content"), str)), "messages")
    elif isinstance(item.get("prompt"), str):
        messages, label = [{"role": "user", "content": item["prompt"]}], item["prompt"]
    else:
        raise ValueError(f"a probe prompt needs 'prompt' (text) or 'messages', got {short(item, 80)}")
    request = item.get("request") or {}
    if not isinstance(request, dict):
        raise ValueError(f"a probe prompt's 'request' must be a mapping of request fields, got {short(request, 60)}")
    return label, messages, request


@check("serve.degeneration", "no probe generation degenerates (n-gram repetition above 0.8, the evaluation metric)")
def degeneration_probe(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    srv = _server(ctx)
    rows = []
    for item in ctx.probe_prompts or DEFAULT_PROBES:
        label, messages, request = _probe_messages(item)
        params = {"max_tokens": ctx.probe_tokens, **request}
        msg = _message(srv.chat(messages, **params))
        generation = _reasoning(msg) + (msg.get("content") or "")
        d = degeneration(generation)
        rows.append({"prompt": label, "degenerate": d.degenerate, "ratio": round(d.ratio, 3), "n": d.n,
                     "words": len(generation.split()), "generation": generation})
    bad = [r for r in rows if r["degenerate"]]
    worst = max(rows, key=lambda r: r["ratio"])
    details = {"probes": rows}
    if bad:
        shown = "; ".join(f"{short(r['prompt'], 30)}: {r['n']}-gram repetition {r['ratio']:.2f}" for r in bad[:3])
        return FAIL, f"{len(bad)} of {len(rows)} probe generations degenerate: {shown}", details
    return PASS, (f"0 of {len(rows)} probe generations degenerate (up to {ctx.probe_tokens} tokens, greedy; worst "
                  f"repetition {worst['ratio']:.2f} at n={worst['n']})"), details
