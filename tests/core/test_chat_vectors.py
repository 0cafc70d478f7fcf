"""The chat template against the rendering vectors, from Python and through transformers."""

from __future__ import annotations

import pytest
from _vectors import VECTORS

from apertus_plugins.chat import ChatFormatError, jinja_template, render
from apertus_plugins.tokenizer_builder import build_test_tokenizer


def test_the_vectors_are_there():
    assert len(VECTORS) >= 8


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_render_matches_vector(vec):
    assert render(**vec["input"]) == vec["rendered"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_test_tokenizer(tmp_path_factory.mktemp("tok_tpl")))


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_hf_apply_chat_template_matches_vector(vec, hf_tokenizer):
    inp = dict(vec["input"])
    messages = inp.pop("messages")
    got = hf_tokenizer.apply_chat_template(messages, tokenize=False, **inp)
    assert got == vec["rendered"]


def test_training_variant_has_an_empty_system_block():
    msgs = [{"role": "user", "content": "Hi"}]
    out = render(msgs, variant="training")
    assert out.startswith("<s><|system_start|><|system_end|><|developer_start|>")
    assert "Apertus 1.5 Omni" not in out
    # with a system message both variants agree
    with_sys = [{"role": "system", "content": "Be brief."}] + msgs
    assert render(with_sys, variant="training") == render(with_sys)
    assert jinja_template("training") != jinja_template("inference")


def test_openai_style_parts_render_as_the_canonical_shape():
    openai = [{"role": "user", "content": [
        {"type": "text", "text": "Describe "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " and "},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]}]
    canonical = [{"role": "user", "content": {"parts": [
        {"type": "text", "text": "Describe "}, {"type": "image"}, {"type": "text", "text": " and "}, {"type": "audio"},
    ]}}]
    assert render(openai, add_generation_prompt=True) == render(canonical, add_generation_prompt=True)


def test_reasoning_content_renders_as_thoughts():
    a = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}]
    b = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": {"blocks": [
        {"type": "thoughts", "text": "Add them."}, {"type": "response", "text": "4"}]}}]
    assert render(a, enable_thinking=True) == render(b, enable_thinking=True)


def test_parallel_tool_outputs_share_one_span_and_continue_message():
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"function": {"name": "a", "arguments": {"q": 1}}}, {"function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    out = render(msgs)
    assert out.endswith('<|tools_prefix|>[{"a": {"q": 1}}, {"b": {}}]<|tools_suffix|>'
                       "<|tool_output_start|>1, 2<|tool_output_end|>done<|assistant_end|>")
    assert render(msgs, continue_assistant_message=True).endswith("done")


def test_tool_declarations_cover_the_type_mapping():
    tools = [{"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
        "type": "object", "properties": {
            "n": {"type": ["integer", "null"]},
            "u": {"oneOf": [{"type": "string"}, {"type": "number"}]},
            "x": {"type": "string", "nullable": True},
            "deep": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
            "objs": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}},
            "flag": {"type": "boolean", "default": False},
            "blob": {},
        }, "required": ["n"]}}},
        {"type": "function", "function": {"name": "g", "description": "No params."}}]
    out = render([{"role": "user", "content": "hi"}], tools=tools)
    decl = out.split("Tool Capabilities:\n", 1)[1].split("<|developer_end|>")[0]
    assert decl == (
        "// F.\ntype f = (_: {\nn: number | null,\nu?: string | number,\nx?: string | null,\n"
        "deep?: any[],\nobjs?: any[],\nflag?: boolean, // default: False,\nblob?: any\n}) => any;\n"
        "// No params.\ntype g = () => any;"
    )


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "robot", "content": "x"}], "message 0: unknown role 'robot'"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "message 1: a tool message must follow"),
    ([{"role": "user", "content": [{"type": "video", "url": "v"}]}], "message 0, part 0: unknown content part type 'video'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "message 1, tool call 0: tool call 'f' has arguments that are not JSON"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "message 1: a system message may only be the first"),
])
def test_invalid_messages_name_the_message_index(messages, pattern):
    with pytest.raises(ChatFormatError, match=pattern.replace("(", "\\(").replace("'", "'")):
        render(messages)
