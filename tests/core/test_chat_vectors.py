"""The chat template against rendering vectors: the project's shared vectors and 300+ renders of the
released (canonical) template, from Python, through transformers and through ``apertus render``."""

from __future__ import annotations

import json
import re

import pytest
from _vectors import CANONICAL, CANONICAL_DOC, REJECTED, RENDERED, VECTORS, kwargs_of

from apertus_plugins.cli import main as cli_main
from apertus_plugins.core.chat import ChatFormatError, jinja_template, render
from apertus_plugins.core.chat.template import normalize_messages, reasoning_as_blocks
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_test_tokenizer(tmp_path_factory.mktemp("tok_tpl")))


def _hf_render(tok, vec: dict) -> str:
    inp = dict(vec["input"])
    messages = inp.pop("messages")
    return tok.apply_chat_template(messages, tokenize=False, chat_template=jinja_template(vec.get("variant", "inference")),
                                   **inp)


# ---------------------------------------------------------------- the shared vectors
def test_the_shared_vectors_are_there():
    assert len(VECTORS) >= 8


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_render_matches_shared_vector(vec):
    assert render(**vec["input"]) == vec["rendered"]


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_hf_apply_chat_template_matches_shared_vector(vec, hf_tokenizer):
    inp = dict(vec["input"])
    messages = inp.pop("messages")
    assert hf_tokenizer.apply_chat_template(messages, tokenize=False, **inp) == vec["rendered"]


# ---------------------------------------------------------------- the canonical renders
def test_the_canonical_vector_file_is_complete():
    assert len(RENDERED) >= 300 and len(REJECTED) >= 15
    assert CANONICAL_DOC["count"] == len(CANONICAL)
    assert isinstance(CANONICAL_DOC["seed"], int) and re.fullmatch(r"[0-9a-f]{32}", CANONICAL_DOC["oracle_md5"])
    assert len({v["name"] for v in CANONICAL}) == len(CANONICAL)
    assert sum(v.get("variant") == "training" for v in RENDERED) >= 50


def _walk(obj):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def _schemas(vec):
    for tool in vec["input"].get("tools") or []:
        fn = tool.get("function", tool)
        for s in _walk(fn.get("parameters") or {}):
            if isinstance(s, dict) and ("type" in s or "oneOf" in s):
                yield s


def _blocks(vec):
    for m in vec["input"]["messages"]:
        c = m.get("content")
        if isinstance(c, dict) and "blocks" in c:
            yield [b["type"] for b in c["blocks"]]


def _has_default_of(kind: type):
    return lambda v: any(type(s.get("default", ...)) is kind for s in _schemas(v))


def _has_part(kind: str):
    return lambda v: any(isinstance(m.get("content"), dict) and any(p.get("type") == kind
                                                                    for p in m["content"].get("parts", []))
                         for m in v["input"]["messages"])


COVERAGE = {
    "string user content": lambda v: any(m["role"] == "user" and isinstance(m.get("content"), str)
                                          for m in v["input"]["messages"]),
    "parts user content": lambda v: any(isinstance(m.get("content"), dict) and "parts" in m["content"]
                                         for m in v["input"]["messages"]),
    "system as string": lambda v: isinstance(v["input"]["messages"][0].get("content"), str)
                                  and v["input"]["messages"][0]["role"] == "system",
    "system as mapping": lambda v: v["input"]["messages"][0]["role"] == "system"
                                   and isinstance(v["input"]["messages"][0]["content"], dict),
    "nested object": lambda v: any(s.get("type") == "object" and any(
        isinstance(p, dict) and p.get("type") == "object" and p.get("properties")
        for p in (s.get("properties") or {}).values()) for s in _schemas(v)),
    "array of objects": lambda v: any(s.get("type") == "array" and isinstance(s.get("items"), dict)
                                      and s["items"].get("type") == "object" for s in _schemas(v)),
    "array of arrays": lambda v: any(s.get("type") == "array" and isinstance(s.get("items"), dict)
                                     and s["items"].get("type") == "array" for s in _schemas(v)),
    "union": lambda v: any(isinstance(s.get("type"), list) and len(s["type"]) > 1 for s in _schemas(v)),
    "oneOf": lambda v: any("oneOf" in s for s in _schemas(v)),
    "enum": lambda v: any(s.get("enum") for s in _schemas(v)),
    "nullable": lambda v: any(s.get("nullable") for s in _schemas(v)),
    "multi-line description": lambda v: any("\n" in str(s.get("description", "")) for s in _schemas(v)),
    **{f"default {t.__name__}": _has_default_of(t) for t in (str, int, float, bool, list, dict)},
    "default null": lambda v: any("default" in s and s["default"] is None for s in _schemas(v)),
    "tool without parameters": lambda v: any(not (t.get("function", t).get("parameters") or {}).get("properties")
                                             for t in v["input"].get("tools") or []),
    "bare tool": lambda v: any("function" not in t for t in v["input"].get("tools") or []),
    "parallel calls": lambda v: any(len(m.get("tool_calls") or []) > 1 for m in v["input"]["messages"]),
    "call inside thinking": lambda v: any("thoughts" in b and "tool_calls" in b[b.index("thoughts"):]
                                          for b in _blocks(v)),
    "call last in the message": lambda v: any(b and b[-1] == "tool_calls" for b in _blocks(v))
                                          or (v["input"]["messages"][-1].get("tool_calls") is not None),
    "answer tool": lambda v: "display_answers" in json.dumps(v["input"]),
    "parallel tool messages": lambda v: any(a["role"] == b["role"] == "tool" for a, b in
                                            zip(v["input"]["messages"], v["input"]["messages"][1:], strict=False)),
    "parallel block outputs": lambda v: any(isinstance(m.get("content"), dict) and any(
        b["type"] == "tool_outputs" and len(b["outputs"]) > 1 for b in m["content"].get("blocks", []))
        for m in v["input"]["messages"]),
    "all four block types": lambda v: any(set(b) == {"thoughts", "response", "tool_calls", "tool_outputs"}
                                          for b in _blocks(v)),
    "reasoning_content": lambda v: any("reasoning_content" in m for m in v["input"]["messages"]),
    "thinking on": lambda v: v["input"].get("enable_thinking") is True,
    "thinking off": lambda v: v["input"].get("enable_thinking") is False,
    "generation prompt": lambda v: v["input"].get("add_generation_prompt") is True,
    "continued assistant message": lambda v: v["input"].get("continue_assistant_message") is True,
    "training variant": lambda v: v.get("variant") == "training",
    **{f"part {k}": _has_part(k) for k in ("text", "image", "image_url", "input_image", "audio", "audio_url",
                                           "input_audio")},
}


@pytest.mark.parametrize("construct", sorted(COVERAGE))
def test_the_canonical_vectors_cover_every_construct(construct):
    n = sum(1 for v in RENDERED if COVERAGE[construct](v))
    assert n >= 3, f"only {n} vectors cover {construct}"


@pytest.mark.parametrize("vec", RENDERED, ids=[v["name"] for v in RENDERED])
def test_render_matches_canonical(vec):
    assert render(**kwargs_of(vec)) == vec["rendered"]


@pytest.mark.parametrize("vec", RENDERED, ids=[v["name"] for v in RENDERED])
def test_hf_apply_chat_template_matches_canonical(vec, hf_tokenizer):
    assert _hf_render(hf_tokenizer, vec) == vec["rendered"]


def test_cli_render_prints_every_canonical_render(tmp_path, capsys):
    for vec in RENDERED:
        f = tmp_path / f"{vec['name']}.json"
        f.write_text(json.dumps(vec["input"]))
        assert cli_main(["render", str(f), "--variant", vec.get("variant", "inference")]) == 0
        assert capsys.readouterr().out == vec["rendered"], vec["name"]


#: What the released template refuses but OpenAI clients send, accepted on purpose: a tool without
#: its optional ``description`` renders as the released template renders an empty one.
ACCEPTED = {"rejected_tool_without_description"}


@pytest.mark.parametrize("vec", [v for v in REJECTED if v["name"] not in ACCEPTED],
                         ids=[v["name"] for v in REJECTED if v["name"] not in ACCEPTED])
def test_what_the_released_template_rejects_is_a_clear_error(vec, hf_tokenizer):
    with pytest.raises(ChatFormatError, match=r"^(message \d+|tool \d+)"):
        render(**kwargs_of(vec))
    with pytest.raises(Exception, match=r"(message \d+|tool \d+)"):  # the Jinja source alone, as transformers runs it
        _hf_render(hf_tokenizer, vec)


def test_a_tool_without_description_renders_as_an_empty_description(hf_tokenizer):
    """The OpenAI schema makes a tool's description optional and clients omit it (or send null). The
    released template refuses it (UndefinedError) and renders an empty description as ``// `` on its
    own line: a missing one renders exactly so, through render() and through the Jinja source."""
    (vec,) = [v for v in REJECTED if v["name"] in ACCEPTED]
    empty = {"messages": vec["input"]["messages"],
             "tools": [{"type": "function", "function": {"name": "f", "description": ""}}]}
    want = render(**empty)
    assert "Tool Capabilities:\n// \ntype f = () => any;<|developer_end|>" in want
    for fn in ({"name": "f"}, {"name": "f", "description": None}, {"name": "f", "description": None, "parameters": None}):
        tools = [{"type": "function", "function": fn}]
        assert render(vec["input"]["messages"], tools=tools) == want
        assert _hf_render(hf_tokenizer, {"input": {"messages": vec["input"]["messages"], "tools": tools}}) == want
    with pytest.raises(ChatFormatError, match=r"^tool 0 \(f\): a tool's 'description' must be a string"):
        render(vec["input"]["messages"], tools=[{"type": "function", "function": {"name": "f", "description": 7}}])


# ---------------------------------------------------------------- single behaviours, spelled out
def test_training_variant_has_an_empty_system_block():
    msgs = [{"role": "user", "content": "Hi"}]
    out = render(msgs, variant="training")
    assert out.startswith("<s><|system_start|><|system_end|><|developer_start|>")
    assert "Apertus 1.5 Omni" not in out
    with_sys = [{"role": "system", "content": "Be brief."}] + msgs
    assert render(with_sys, variant="training") == render(with_sys)
    assert jinja_template("training") != jinja_template("inference")


def test_openai_style_lists_render_as_the_canonical_shape():
    openai = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
              {"role": "user", "content": [
                  {"type": "text", "text": "Describe "},
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                  {"type": "text", "text": " and "},
                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
              {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    canonical = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": {"parts": [
                     {"type": "text", "text": "Describe "}, {"type": "image"}, {"type": "text", "text": " and "},
                     {"type": "audio"}]}},
                 {"role": "assistant", "content": "A cat."}]
    assert render(openai) == render(canonical)
    assert normalize_messages(openai)[1]["content"]["parts"][1]["type"] == "image_url"


def test_reasoning_content_is_not_rendered_and_converts_to_blocks():
    a = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}]
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert render(a, enable_thinking=True) == render(plain, enable_thinking=True)  # as the released template
    blocks = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": {"blocks": [
        {"type": "thoughts", "text": "Add them."}, {"type": "response", "text": "4"}]}}]
    assert reasoning_as_blocks(a) == blocks
    assert render(reasoning_as_blocks(a), enable_thinking=True).endswith(
        "<|assistant_start|><|inner_prefix|>Add them.<|inner_suffix|>4<|assistant_end|>")
    assert reasoning_as_blocks(plain) is plain


def test_tool_calls_inside_thinking_keep_one_span():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": {"blocks": [
        {"type": "thoughts", "text": "look up"},
        {"type": "tool_calls", "calls": [{"name": "f", "arguments": '{"q": 1}'}, {"name": "g", "arguments": "{}"}]},
        {"type": "tool_outputs", "outputs": [{"output": "1"}, {"output": "2"}]},
        {"type": "thoughts", "text": "so"},
        {"type": "tool_calls", "calls": [{"name": "display_answers", "arguments": '{"answers": ["3"]}'}]}]}}]
    assert render(msgs).endswith(
        '<|assistant_start|><|inner_prefix|>look up<|tools_prefix|>[{"f": {"q": 1}}, {"g": {}}]<|tools_suffix|>'
        "<|tool_output_start|>1, 2<|tool_output_end|>so<|inner_suffix|>"
        '<|tools_prefix|>[{"display_answers": {"answers": ["3"]}}]<|tools_suffix|>')  # the turn stays open


def test_tool_outputs_with_generation_prompt_close_the_turn_as_released():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "a", "arguments": {"q": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
            {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    out = render(msgs, add_generation_prompt=True)
    assert out.endswith('<|tools_prefix|>[{"a": {"q": 1}}, {"b": {}}]<|tools_suffix|>'
                        "<|tool_output_start|>1, 2<|tool_output_end|><|assistant_end|><|assistant_start|>")
    waiting = render(msgs[:2], add_generation_prompt=True)
    assert waiting.endswith("<|tools_suffix|><|assistant_start|>")  # a call waiting for outputs stays open
    done = render(msgs + [{"role": "assistant", "content": "done"}], continue_assistant_message=True)
    assert done.endswith("<|tool_output_end|>done")


def test_tool_declarations_follow_the_released_layout():
    tools = [{"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
        "type": "object", "properties": {
            "n": {"type": ["integer", "null"]},
            "u": {"oneOf": [{"type": "string", "description": "text"}, {"type": "number", "default": 1}]},
            "x": {"type": "string", "nullable": True},
            "deep": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
            "objs": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}},
            "long": {"type": "array", "items": {"type": "object", "properties": {
                "first": {"type": "string"}, "second": {"type": "integer"}}}},
            "flag": {"type": "boolean", "default": False},
            "pick": {"type": "string", "enum": ["a", "b"], "default": "a"},
            "blob": {},
        }, "required": ["n"]}}},
        {"type": "function", "function": {"name": "g", "description": "No params."}}]
    out = render([{"role": "user", "content": "hi"}], tools=tools)
    decl = out.split("Tool Capabilities:\n", 1)[1].split("<|developer_end|>")[0]
    assert decl == (
        "// F.\ntype f = (_: {\nn: integer | null,\n"
        "u?: string// text | \nnumber                    // default: 1,\n"
        "x?: string | null,\ndeep?: string[][],\n"
        "objs?: {\na?: \n                string}[],\n"
        "long?: any[],\n"  # the item type is longer than 50 characters
        "flag?: boolean, // default: false,\npick?: \"a\" | \"b\", // default: a,\nblob?: any\n}) => any;\n"
        "// No params.\ntype g = () => any;"
    )


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "robot", "content": "x"}], "message 0: unknown role 'robot'"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "message 1: a tool message must follow"),
    ([{"role": "user", "content": [{"type": "video", "url": "v"}]}], "message 0, part 0: unknown content part type 'video'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                          "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "message 1, tool_calls, call 0 (f): arguments are not JSON"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "message 1: a system message may only be the first"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": {"blocks": [
        {"type": "tool_outputs", "outputs": ["bare text"]}]}}], "message 1, block 0: tool outputs must be a list of"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "image"}]}],
     "message 1, part 0: only text parts can stand here"),
])
def test_invalid_messages_name_the_message_index(messages, pattern):
    with pytest.raises(ChatFormatError, match=re.escape(pattern)):
        render(messages)
