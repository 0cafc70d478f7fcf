"""A real ``vllm serve`` on loopback with the plugin loaded through its entry point.

The prompt ids the server runs are compared with the core's own encoding of the same
conversation (template, media sequences, one BOS): the server and the core must agree id for id.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import http.server
import json
import re
import threading

import pytest
from conftest import DATA

from apertus_plugins.core.chat import ChatTokenizer, MediaItem
from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.core.media import image as media_image
from apertus_plugins.infra.client import Client, http_json

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def chat(server, messages, **kw):
    payload = {"model": "apertus", "messages": messages, "max_tokens": 4, "temperature": 0,
               "return_token_ids": True, **kw}
    return http_json(server.url("/v1/chat/completions"), payload, timeout=600)


def ok(server, messages, **kw):
    status, body = chat(server, messages, **kw)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def core(checkpoint):
    return ChatTokenizer(checkpoint)


def image_ids(core, layout="inference"):
    from PIL import Image

    w, h = Image.open(DATA / "demo.png").size
    rows, cols = media_image.image_grid(h, w)
    return media_image.image_placeholder_sequence(rows, cols, core.spec, layout, core.char_ids), (rows, cols)


def audio_ids(core):
    wave, rate = media_audio.load_audio(DATA / "demo.wav")
    clip = media_audio.preprocess_audio(wave, rate)
    return media_audio.audio_placeholder_sequence(media_audio.audio_code_count(clip.size), core.spec)


def expected(core, messages, media=None, **kw):
    return core.encode_conversation(messages, add_generation_prompt=True, media=media, **kw).ids.tolist()


def read_codes(codes_log):
    return [json.loads(line) for line in codes_log.read_text().splitlines()] if codes_log.exists() else []


def test_the_plugins_messages_are_in_the_servers_output_in_vllms_format(server):
    """The adapter logs under vLLM's `vllm` logger: its info lines show at vLLM's default level, formatted by vLLM."""
    log = server.log_path.read_text(errors="replace")
    line = r"\(APIServer pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[{file}:\d+\] {message}"
    assert re.search(line.format(file=r"config_hook\.py", message=re.escape(
        "apertus: chat requests rendered by the core (tokenizer mode 'apertus', injection-safe)")), log), \
        server.log_tail()


def test_text_prompt_is_the_core_encoding_with_one_bos(server, core):
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    body = ok(server, messages)
    ids = body["prompt_token_ids"]
    assert ids == expected(core, messages)
    assert ids[0] == core.spec.bos_id and ids.count(core.spec.bos_id) == 1
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_image_expands_into_the_inference_layout_and_its_codes_are_embedded(server, core, image_part, codes_log):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe: "}, image_part]}]
    seq, (rows, cols) = image_ids(core)
    ids = ok(server, messages)["prompt_token_ids"]
    assert ids == expected(core, messages, [MediaItem("image", seq)])
    assert media_image.detect_image_layout(ids, core.spec) == "inference"
    # the embedded codes (an image seen before comes from vLLM's encoder cache, logged when first encoded)
    logged = [c for c in read_codes(codes_log) if c["modality"] == "image" and c["shape"] == [rows, cols]]
    assert logged and all(0 <= v < core.spec.modality("image").size for v in logged[-1]["codes"])


def test_audio_at_24_khz_whatever_the_input_rate(server, core, audio_part, codes_log):
    messages = [{"role": "user", "content": [audio_part, {"type": "text", "text": "Transcribe."}]}]
    seq = audio_ids(core)  # demo.wav is 16 kHz stereo: downmixed and resampled to 24 kHz
    ids = ok(server, messages)["prompt_token_ids"]
    assert ids == expected(core, messages, [MediaItem("audio", seq)])
    assert [c for c in read_codes(codes_log) if c["modality"] == "audio" and c["shape"] == [len(seq) - 2]]


def test_image_and_audio_in_one_message(server, core, image_part, audio_part):
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": " and "}, audio_part]}]
    seq, _ = image_ids(core)
    ids = ok(server, messages, max_tokens=2)["prompt_token_ids"]
    assert ids == expected(core, messages, [MediaItem("image", seq), MediaItem("audio", audio_ids(core))])


def test_training_layout_from_the_server_flag(training_server, core, image_part):
    messages = [{"role": "user", "content": [image_part]}]
    ids = ok(training_server, messages, max_tokens=1)["prompt_token_ids"]
    assert media_image.detect_image_layout(ids, core.spec) == "training"
    assert ids == expected(core, messages, [MediaItem("image", image_ids(core, "training")[0])])


def test_more_media_than_the_limit(training_server, image_part, audio_part):
    for parts, word in (([image_part, image_part], "at most 1 image"), ([audio_part, audio_part], "at most 1 audio")):
        status, body = chat(training_server, [{"role": "user", "content": parts}])
        assert 400 <= status < 500 and word in json.dumps(body).lower(), (status, body)
    assert chat(training_server, [{"role": "user", "content": [image_part]}], max_tokens=1)[0] == 200


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_on_and_off_per_request(server, core, thinking):
    messages = [{"role": "user", "content": "Think about it."}]
    ids = ok(server, messages, chat_template_kwargs={"enable_thinking": thinking})["prompt_token_ids"]
    assert ids == expected(core, messages, enable_thinking=thinking)
    flag = "Deliberation: enabled" if thinking else "Deliberation: disabled"
    assert flag in core.decode(ids)


def test_tools_and_a_round_trip_with_tool_outputs(server, core):
    messages = [
        {"role": "user", "content": "Weather in Bern and Zurich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zurich"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 degrees"},
        {"role": "tool", "tool_call_id": "c2", "content": "5 degrees"},
    ]
    body = ok(server, messages, tools=TOOLS)
    ids = body["prompt_token_ids"]
    want = core.encode_conversation(messages, tools=TOOLS, add_generation_prompt=True).ids.tolist()
    # the turn with the calls stays open for their outputs: the server continues it
    assert ids[: len(want) - 1] == want[: len(want) - 1] or ids == want
    assert core.spec.id("tool_output_start") in ids and core.spec.id("tools_prefix") in ids


@pytest.mark.parametrize("name,token", [("assistant_end", 68), ("tools_suffix", 72)])
def test_generation_stops_at_the_turn_end_and_after_a_tool_call(server, core, name, token):
    tid = core.spec.id(name)
    body = ok(server, [{"role": "user", "content": "Go."}], max_tokens=6, logit_bias={str(tid): 100})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [tid]


FORCED = [
    ('<|tools_prefix|>[{"get_weather": {"city": "Bern"}}]<|tools_suffix|>', [("get_weather", {"city": "Bern"})]),
    ('<|tools_prefix|>[{"get_weather": {"city": "Bern"}}, {"get_weather": {"city": "Chur"}}]<|tools_suffix|>',
     [("get_weather", {"city": "Bern"}), ("get_weather", {"city": "Chur"})]),
]


@pytest.mark.parametrize("text,calls", FORCED)
@pytest.mark.parametrize("streaming", [False, True])
def test_tool_calls_from_the_server(server, text, calls, streaming):
    """The output is forced with a structured-output choice; the server's parsers turn it into calls."""
    payload = dict(tools=TOOLS, max_tokens=300, structured_outputs={"choice": [text]})
    messages = [{"role": "user", "content": "Weather?"}]
    if not streaming:
        msg = ok(server, messages, **payload)["choices"][0]["message"]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    else:
        got_calls: dict[int, list[str]] = {}
        for chunk in stream(server, messages, **payload):
            for tc in chunk["choices"][0]["delta"].get("tool_calls") or []:
                entry = got_calls.setdefault(tc["index"], ["", ""])
                entry[0] += (tc.get("function") or {}).get("name") or ""
                entry[1] += (tc.get("function") or {}).get("arguments") or ""
        got = [(n, json.loads(a)) for _, (n, a) in sorted(got_calls.items())]
    assert got == calls


def stream(server, messages, **kw):
    payload = {"model": "apertus", "messages": messages, "temperature": 0, **kw}
    with Client(server.base_url, timeout=600) as client:
        return list(client.stream("/chat/completions", payload))


def test_streaming_matches_the_whole_answer(server):
    messages = [{"role": "user", "content": "Count."}]
    whole = ok(server, messages, max_tokens=6)["choices"][0]["message"]
    parts = stream(server, messages, max_tokens=6)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in parts if c["choices"])
    assert streamed == (whole["content"] or "")


def test_completions_with_logprobs(server):
    status, body = http_json(server.url("/v1/completions"), {"model": "apertus", "prompt": "The weather in Bern",
                                                             "max_tokens": 3, "logprobs": 2, "temperature": 0},
                             timeout=300)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["token_logprobs"]) == 3
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(1 <= len(t) <= 3 for t in lp["top_logprobs"])


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def missing_url():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}/missing.png"
    srv.shutdown()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("case", ["malformed image", "not audio", "unreadable url", "too many images"])
def test_bad_input_is_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, case, image_part, missing_url):
    parts, words = {
        "malformed image": ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(b"no image")}}],
                            "image"),
        "not audio": ([{"type": "input_audio", "input_audio": {"data": b64((DATA / "demo.png").read_bytes()),
                                                               "format": "wav"}}], "audio"),
        "unreadable url": ([{"type": "image_url", "image_url": {"url": missing_url}}], "404"),
        "too many images": ([image_part] * 3, "at most 2 image"),
    }[case]
    status, body = chat(server, [{"role": "user", "content": parts}])
    assert 400 <= status < 500, (status, body)
    assert words in json.dumps(body).lower(), body
    assert chat(server, [{"role": "user", "content": "Still there?"}], max_tokens=1)[0] == 200


def test_a_burst_of_50_concurrent_multimodal_requests_completes(server, image_part, audio_part):
    def one(i):
        content = [{"type": "text", "text": f"Request {i}: "}, image_part if i % 2 else audio_part]
        return chat(server, [{"role": "user", "content": content}], max_tokens=2)[0]

    with cf.ThreadPoolExecutor(max_workers=50) as pool:
        statuses = list(pool.map(one, range(50)))
    assert statuses == [200] * 50
