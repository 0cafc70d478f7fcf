"""The plugin's ``apertus`` tool parser against the one it replaces, vLLM's own ``apertus`` tool parser.

``--tool-call-parser apertus`` used to select vLLM's parser (vllm/tool_parsers/apertus_tool_parser.py); the
plugin registers its own under that name. Every case below runs through BOTH, whole and streamed token by
token as vLLM streams them, and is scored against what a client should get: the plugin's parser must be
right wherever vLLM's is, and it is right in every case. Where the two differ, vLLM's parser turns text cut
off inside a value into a call with made-up arguments (``"Lon"`` for ``"London"``), or streams arguments
that are not JSON; the plugin salvages only what the text proves (``core.chat.parse.salvage_json``).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.apertus_tool_parser import ApertusToolParser as VLLMApertusToolParser

from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer
from vllm_model.parsers import ApertusToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
P, S = "<|tools_prefix|>", "<|tools_suffix|>"
LONDON = ("get_weather", {"location": "London"})

# (case, generated text, cut off by max_tokens, the calls a client should get, its content (None: none))
CASES = [
    ("no call", "Plain answer.", False, [], "Plain answer."),
    ("a call", f'{P}[{{"get_weather": {{"location": "London"}}}}]{S}', False, [LONDON], None),
    ("terminator stopped", f'{P}[{{"get_weather": {{"location": "London"}}}}]', False, [LONDON], None),
    ("cut before }]", f'{P}[{{"get_weather": {{"location": "London"}}', True, [LONDON], None),
    ("cut before ]", f'{P}[{{"get_weather": {{"location": "London"}}}}', True, [LONDON], None),
    ("cut after a comma", f'{P}[{{"get_weather": {{"location": "London"}}}},', True, [LONDON], None),
    ("parallel", f'{P}[{{"get_time": {{}}}}, {{"get_weather": {{"location": "London"}}}}]{S}', False,
     [("get_time", {}), LONDON], None),
    ("parallel, cut in the second", f'{P}[{{"get_time": {{}}}}, {{"get_weather": {{"location": "Lon', True,
     [("get_time", {})], None),
    ("text, then a call", f'Checking. {P}[{{"get_weather": {{"location": "London"}}}}]{S}', False, [LONDON],
     "Checking."),
    ("a call, then text", f'{P}[{{"get_time": {{}}}}]{S} Done.', False, [("get_time", {})], "Done."),
    ("a call, then text, no terminator", f'{P}[{{"get_time": {{}}}}] Done.', False, [("get_time", {})], "Done."),
    ("one object, no array", f'{P}{{"get_time": {{}}}}{S}', False, [("get_time", {})], None),
    ("unicode", f'{P}[{{"get_weather": {{"location": "Zürich"}}}}]{S}', False,
     [("get_weather", {"location": "Zürich"})], None),
    ("empty array", f"{P}[]{S}", False, [], None),
    # cut inside a value: no call is right (the value may go on); vLLM's parser makes one up
    ("cut in a string", f'{P}[{{"get_weather": {{"location": "Lon', True, [], None),
    ("cut in a number", f'{P}[{{"get_weather": {{"days": 1', True, [], None),
    ("cut after a key", f'{P}[{{"get_weather": {{"location"', True, [], None),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = build_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", VocabSpec.scaled())
    return AutoTokenizer.from_pretrained(str(d))


def _request(max_tokens: int | None) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 max_tokens=max_tokens)


def _args(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return f"not JSON: {text!r}"


def whole(parser_cls, tok, text: str, cut: bool) -> tuple[list, str | None]:
    parser = parser_cls(tok)
    ids = tok.encode(text, add_special_tokens=False)
    req = parser.adjust_request(_request(len(ids) if cut else None))
    info = parser.extract_tool_calls(text, req)
    calls = [(c.function.name, _args(c.function.arguments)) for c in info.tool_calls] if info.tools_called else []
    return calls, (info.content or "").strip() or None


def streamed(parser_cls, tok, text: str, cut: bool) -> tuple[list, str | None]:
    parser = parser_cls(tok)
    ids = tok.encode(text, add_special_tokens=False)
    req = parser.adjust_request(_request(len(ids) if cut else None))
    previous, content, calls, sent = "", "", {}, 0
    for k in range(len(ids)):
        current = tok.decode(ids[: k + 1], skip_special_tokens=False)
        if current.endswith("\ufffd") and k < len(ids) - 1:
            continue  # a character split across tokens: vLLM's detokenizer waits for the rest too
        delta = current[len(previous):]
        msg = parser.extract_tool_calls_streaming(previous, current, delta, ids[:sent], ids[: k + 1],
                                                  ids[sent: k + 1], req)
        previous, sent = current, k + 1
        if msg is None:
            continue
        content += msg.content or ""
        for tc in msg.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
    return [(n, _args(a)) for _, (n, a) in sorted(calls.items())], content.strip() or None


@pytest.mark.parametrize("mode", [whole, streamed], ids=["whole", "streamed"])
@pytest.mark.parametrize("case,text,cut,calls,content", CASES, ids=[c[0] for c in CASES])
def test_the_plugins_parser_is_right_wherever_vllms_is(tok, mode, case, text, cut, calls, content):
    vllm_calls, vllm_content = mode(VLLMApertusToolParser, tok, text, cut)
    ours_calls, ours_content = mode(ApertusToolParser, tok, text, cut)
    vllm_right = vllm_calls == calls and (content is None or vllm_content == content)
    ours_right = ours_calls == calls and (content is None or ours_content == content)
    assert ours_right or not vllm_right, (case, "vLLM's", vllm_calls, vllm_content, "ours", ours_calls, ours_content)
    assert ours_right, (case, ours_calls, ours_content)  # and right where vLLM's is not


def test_the_issues_cut_off_call_is_salvaged_where_vllms_salvages_it(tok):
    """A call cut off by max_tokens came back as content with the raw marker in it; now it is the call,
    whole as vLLM's parser gives it, and streamed too (vLLM's streams arguments that are not JSON)."""
    text = f'{P}[{{"get_weather": {{"location": "London"}}'
    assert whole(ApertusToolParser, tok, text, True) == whole(VLLMApertusToolParser, tok, text, True) == (
        [LONDON], None)
    assert streamed(ApertusToolParser, tok, text, True) == ([LONDON], None)
    assert streamed(VLLMApertusToolParser, tok, text, True) == (
        [("get_weather", """not JSON: '{"location": "London'""")], None)
