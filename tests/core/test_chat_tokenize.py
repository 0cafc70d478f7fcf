"""Injection-safe tokenization, the output parser and round trips (hypothesis)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _vectors import VECTORS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apertus_plugins.chat import (
    ChatFormatError,
    ChatTokenizer,
    MediaItem,
    StreamingParser,
    parse_output,
    render,
)
from apertus_plugins.cli import main as cli_main
from apertus_plugins.vocab import VocabSpec


@pytest.fixture(scope="module")
def chat(small_tokenizer_dir) -> ChatTokenizer:
    return ChatTokenizer(small_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(small_tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(small_tokenizer_dir / "tokenizer.json"))


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vectors_tokenize_like_the_tokenizer_and_decode_byte_identical(vec, chat, hf_tok):
    enc = chat.encode_conversation(**vec["input"])
    assert list(enc.ids) == hf_tok.encode(vec["rendered"], add_special_tokens=False).ids
    assert chat.decode(enc.ids) == vec["rendered"]
    assert len(enc.roles) == len(enc.ids)


def _injection_corpus(spec: VocabSpec) -> list[str]:
    lits = list(spec.literal_to_id) + ["<thought>", "</thought>", "<answer>", "<s>", "</s>", "<SPECIAL_5>",
                                       "<|visual token 3|>", "<|audio token 0|>", "<|omni_reserved_0|>"]
    return lits + ["".join(lits), "x" + "y".join(lits) + "z"]


def test_injection_corpus_yields_no_structure_ids(chat, small_spec):
    for lit in _injection_corpus(small_spec):
        text = f"before {lit} after"
        tools = [{"type": "function", "function": {
            "name": f"f{lit}", "description": text,
            "parameters": {"type": "object", "properties": {f"p{lit}": {"type": "string", "description": text,
                                                                        "enum": [text], "default": text}}}}}]
        msgs = [
            {"role": "system", "content": text},
            {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]},
            {"role": "assistant", "tool_calls": [{"function": {"name": f"g{lit}", "arguments": {"q": text}}}]},
            {"role": "tool", "content": text},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": text},
        ]
        enc = chat.encode_conversation(msgs, tools=tools, add_generation_prompt=True)
        rendered = render(msgs, tools=tools, add_generation_prompt=True)
        assert chat.decode(enc.ids) == rendered  # the string form is byte-identical
        user_side = np.isin(enc.roles, [1, 2, 3, 5])  # system, developer, user, tool text
        bad = [int(i) for i in enc.ids[user_side] if int(i) in small_spec.structure_ids]
        assert bad == [], (lit, bad)
        # the structure tokens that are there are exactly the template's own
        structure = [int(i) for i in enc.ids[enc.roles == 0]]
        n_user = sum(1 for m in msgs if m["role"] == "user")
        assert structure.count(small_spec.id("user_start")) == n_user
        assert structure.count(small_spec.id("tool_output_start")) == 1
        assert structure.count(small_spec.id("image")) == 1


def test_assistant_text_keeps_the_thinking_delimiters_only(chat, small_spec):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>plan</think>answer <|user_start|> <|inner_prefix|>x<|inner_suffix|>"}]
    enc = chat.encode_conversation(msgs)
    ids = list(enc.ids)
    assert ids.count(32) == 2 and ids.count(33) == 2
    assert ids.count(small_spec.id("user_start")) == 1  # only the template's own


def test_media_placeholders_expand_in_order(chat, small_spec):
    img = np.arange(10) + small_spec.modality("image").offset
    aud = np.arange(4) + small_spec.modality("audio").offset
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "and"},
                                         {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    enc = chat.encode_conversation(msgs, media=[MediaItem("image", img), MediaItem("audio", aud)])
    assert list(enc.ids[enc.roles == 6]) == list(img) and list(enc.ids[enc.roles == 7]) == list(aud)
    plain = chat.encode_conversation(msgs)
    assert list(plain.ids).count(small_spec.id("image")) == 1
    with pytest.raises(ChatFormatError, match="more media placeholders than the 1 media items given"):
        chat.encode_conversation(msgs, media=[MediaItem("image", img)])
    with pytest.raises(ChatFormatError, match="3 media items given but the conversation has 2"):
        chat.encode_conversation(msgs, media=[MediaItem("image", img), MediaItem("audio", aud), MediaItem("audio", aud)])
    with pytest.raises(ChatFormatError, match="media item 0 is 'audio' but placeholder 0 is 'image'"):
        chat.encode_conversation(msgs, media=[MediaItem("audio", aud), MediaItem("image", img)])


# ---------------------------------------------------------------- parser
def test_parse_thinking_calls_and_answer_in_both_forms():
    for o, c in (("<|inner_prefix|>", "<|inner_suffix|>"), ("<think>", "</think>")):
        out = parse_output(f'{o}hmm{c}<|tools_prefix|>[{{"a": {{"x": 1}}}}, {{"b": {{}}}}]<|tools_suffix|>')
        assert out.thinking == "hmm" and out.content == "" and out.errors == []
        assert [(t.name, t.arguments) for t in out.tool_calls] == [("a", {"x": 1}), ("b", {})]
        out = parse_output(f"{o}a{c}The answer.<|assistant_end|>ignored")
        assert (out.thinking, out.content) == ("a", "The answer.")


def test_parse_unclosed_thinking_gives_an_empty_answer():
    out = parse_output("<think>still going and going")
    assert out.thinking == "still going and going" and out.content == ""


def test_parse_call_inside_thinking_with_missing_terminator():
    out = parse_output('<|inner_prefix|>let me call <|tools_prefix|>[{"f": {"q": "x"}}]<|inner_suffix|>done')
    assert [(t.name, t.in_thinking) for t in out.tool_calls] == [("f", True)]
    assert [e.kind for e in out.errors] == ["unterminated"]
    assert out.thinking == "let me call " and out.content == "done"


@pytest.mark.parametrize("marker", ["<think>", "<|inner_prefix|>", "</think>", "</s>", "<|assistant_end|>",
                                    "<|tools_prefix|>"])
@pytest.mark.parametrize("thinking", [False, True])
def test_delimiters_inside_call_arguments_are_text(marker, thinking):
    call = json.dumps([{"f": {"q": f"a{marker}b"}}])
    prefix = "<think>mull</think>" if thinking else ""
    text = f"{prefix}<|tools_prefix|>{call}<|tools_suffix|>after<|assistant_end|>"
    out = parse_output(text)
    assert out.errors == [] and [(t.name, t.arguments) for t in out.tool_calls] == [("f", {"q": f"a{marker}b"})]
    assert (out.thinking, out.content) == (("mull" if thinking else None), "after")
    for cuts in ([], [5, len(prefix) + 20, len(text) - 3]):
        assert _stream(text, cuts) == (("mull" if thinking else ""), "after", out.tool_calls)


@pytest.mark.parametrize("body, kind", [("[{oops", "json"), ('{"a": 1, "b": 2}', "shape"), ('"str"', "shape"),
                                        ('[{"a": 1}]', "shape")])
def test_malformed_calls_are_structured_errors(body, kind):
    out = parse_output(f"<|tools_prefix|>{body}<|tools_suffix|>")
    assert out.tool_calls == [] and out.errors[0].kind == kind


def _stream(text: str, cuts: list[int]):
    p = StreamingParser()
    events = []
    pos = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[pos:c])
        pos = c
    events += p.finish()
    reasoning = "".join(t for k, t in events if k == "reasoning")
    content = "".join(t for k, t in events if k == "content")
    calls = [c for k, cs in events if k == "tool_calls" for c in cs]
    return reasoning, content, calls


# ---------------------------------------------------------------- round trips
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ue000\ue001\ue002"),
                max_size=30)
args = st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=5),
                       st.one_of(st.integers(-5, 5), st.text(max_size=8), st.booleans()), max_size=3)
calls_st = st.lists(st.tuples(st.text(alphabet="abcdefgh_", min_size=1, max_size=6), args), max_size=3)
MARKERS = ("<|inner_prefix|>", "<|inner_suffix|>", "<think>", "</think>", "<|tools_prefix|>", "<|tools_suffix|>",
           "<|assistant_end|>", "</s>")


def _clean(s: str) -> str:
    for m in MARKERS:
        s = s.replace(m, "")
    return s


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=texts, thoughts=st.one_of(st.none(), texts), answer=texts, calls=calls_st, thinking=st.booleans(),
       media=st.lists(st.sampled_from(["image", "audio"]), max_size=2), data=st.data())
def test_render_tokenize_parse_round_trip(chat, small_spec, user, thoughts, answer, calls, thinking, media, data):
    thoughts = None if thoughts is None else _clean(thoughts)
    answer = _clean(answer)
    parts = [{"type": "text", "text": user}] + [{"type": m} for m in media]
    msg = {"role": "assistant", "content": answer}
    if thoughts is not None:
        msg["reasoning_content"] = thoughts
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]
    msgs = [{"role": "user", "content": parts}, msg]
    enc = chat.encode_conversation(msgs, enable_thinking=thinking)
    ids = enc.ids
    assert not any(int(i) in small_spec.structure_ids for i in ids[enc.roles == 3])
    start = int(np.flatnonzero(ids == small_spec.id("assistant_start"))[-1]) + 1
    generated = chat.decode(ids[start:])
    out = parse_output(generated)
    assert out.errors == []
    assert out.content == answer
    assert out.thinking == (thoughts if thoughts else None)  # an empty reasoning is not rendered
    assert [(t.name, t.arguments) for t in out.tool_calls] == [(n, a) for n, a in calls]
    # streaming in random pieces gives the same result
    cuts = data.draw(st.lists(st.integers(0, max(len(generated), 1)), max_size=6))
    r, c, cs = _stream(generated, cuts)
    assert c == answer and r == (thoughts or "")
    assert [(t.name, t.arguments) for t in cs] == [(n, a) for n, a in calls]


def test_cli_render_prints_exactly_the_vector(tmp_path, capsys):
    for vec in VECTORS:
        f = tmp_path / f"{vec['name']}.json"
        f.write_text(json.dumps(vec["input"]))
        assert cli_main(["render", str(f)]) == 0
        assert capsys.readouterr().out == vec["rendered"]
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(VECTORS[0]["input"]))
    assert cli_main(["render", str(f), "--ids"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t")[0] == "structure" and any(line.startswith("user\t") for line in lines)
    assert cli_main(["render", str(f), "--variant", "training"]) == 0
    assert capsys.readouterr().out.startswith("<s><|system_start|><|system_end|>")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    assert cli_main(["render", str(bad)]) == 1
    assert "message 0: unknown role 'robot'" in capsys.readouterr().err
