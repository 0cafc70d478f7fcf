"""The ``apertus`` tool and reasoning parsers, composed as the server composes them.

The outputs are tokenized with the test tokenizer and streamed one token at a time, as vLLM
streams them; ``<|tools_suffix|>`` is a stop token, so the streams that end a call leave it out
(the known mis-parse that dropped the terminator of calls made under thinking).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

import vllm_model
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = build_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", VocabSpec.scaled())
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def parser_cls(tok):
    vllm_model.register()
    cls = ParserManager.get_parser(tool_parser_name="apertus", reasoning_parser_name="apertus",
                                   enable_auto_tools=True, tokenizer=tok)
    assert cls.tool_parser_cls.__module__ == "vllm_model.parsers"
    assert cls.reasoning_parser_cls.__module__ == "vllm_model.parsers"
    return cls


def request(tools=True):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=TOOLS if tools else None)


def parse(parser_cls, tok, text, tools=True):
    p = parser_cls(tok)
    req = p.adjust_request(request(tools))
    return p.parse(text, req, enable_auto_tools=tools)


def stream(parser_cls, tok, text, tools=True):
    """Feed ``text`` token by token; returns (reasoning, content, [(name, args)])."""
    p = parser_cls(tok)
    req = p.adjust_request(request(tools))
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("<|assistant_start|>", add_special_tokens=False)
    reasoning, content, calls = "", "", {}
    for k, tid in enumerate(ids):
        delta = tok.decode([tid], skip_special_tokens=False)
        msg = p.parse_delta(delta, [tid], req, prompt_token_ids=prompt, finished=k == len(ids) - 1)
        if msg is None:
            continue
        reasoning += msg.reasoning or ""
        content += msg.content or ""
        for tc in msg.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
    return reasoning, content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


CASES = [
    # (output as the client sees it, reasoning, content, calls)
    ("Plain answer.", None, "Plain answer.", []),
    ("<|inner_prefix|>Let me think.<|inner_suffix|>The answer.", "Let me think.", "The answer.", []),
    ("<think>Short.</think>Done.", "Short.", "Done.", []),
    ('<|tools_prefix|>[{"get_weather": {"city": "Bern"}}]', None, None, [("get_weather", {"city": "Bern"})]),
    ('Checking. <|tools_prefix|>[{"get_weather": {"city": "Bern"}}, {"get_time": {}}]<|tools_suffix|>',
     None, "Checking.", [("get_weather", {"city": "Bern"}), ("get_time", {})]),
    # a call inside the thinking span, its terminator dropped (the generation stopped on it)
    ('<|inner_prefix|>I need the weather.<|tools_prefix|>[{"get_weather": {"city": "Zurich"}}]',
     "I need the weather.", None, [("get_weather", {"city": "Zurich"})]),
    # ... and one whose thinking goes on and closes (a server without the stop)
    ('<think>First.<|tools_prefix|>[{"get_time": {}}]<|tools_suffix|></think>Then this.',
     "First.", "Then this.", [("get_time", {})]),
]


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_whole_output(parser_cls, tok, text, reasoning, content, calls):
    r, c, tool_calls = parse(parser_cls, tok, text)
    assert r == reasoning
    assert (c or None) == content
    assert [(t.name, json.loads(t.arguments)) for t in tool_calls or []] == calls


# streamed: the served cases (generation stops after a call, so no thinking follows one)
@pytest.mark.parametrize("text,reasoning,content,calls", CASES[:-1])
def test_streamed_token_by_token(parser_cls, tok, text, reasoning, content, calls):
    r, c, got = stream(parser_cls, tok, text)
    assert (r or None) == reasoning
    assert (c.strip() or None) == content
    assert got == calls


def test_without_tools_the_thinking_span_is_still_separated(parser_cls, tok):
    r, c, calls = parse(parser_cls, tok, "<|inner_prefix|>Hmm.<|inner_suffix|>Yes.", tools=False)
    assert (r, c, calls or []) == ("Hmm.", "Yes.", [])
    assert stream(parser_cls, tok, "<think>Hmm.</think>Yes.", tools=False)[:2] == ("Hmm.", "Yes.")


def test_unterminated_thinking_is_all_reasoning(parser_cls, tok):
    r, c, _ = parse(parser_cls, tok, "<|inner_prefix|>Still thinking")
    assert r == "Still thinking" and not c


def test_registration_replaces_the_builtin_apertus_tool_parser_and_is_idempotent():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    vllm_model.register()
    vllm_model.register()
    assert ToolParserManager.get_tool_parser("apertus").__module__ == "vllm_model.parsers"
    assert ReasoningParserManager.get_reasoning_parser("apertus").__module__ == "vllm_model.parsers"


# ---------------------------------------------------------------- Apertus 1.0 checkpoints
@pytest.fixture(scope="module")
def tok_1p0(tmp_path_factory):
    """A tokenizer of the Apertus 1.0 shape: the chat tokens, no image or audio markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                "<|assistant_end|>", "<|tools_prefix|>", "<|tools_suffix|>", "<|inner_prefix|>", "<|inner_suffix|>"]
    chars = sorted(set('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]":,.'))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=specials[4:])
    return tok


def test_an_apertus_1p0_tokenizer_keeps_vllms_own_apertus_tool_parser(tok, tok_1p0):
    from vllm.tool_parsers.apertus_tool_parser import ApertusToolParser as VLLMApertus

    from vllm_model.parsers import ApertusToolParser, is_apertus_1p5_tokenizer

    assert is_apertus_1p5_tokenizer(tok) and not is_apertus_1p5_tokenizer(tok_1p0)
    ours, theirs = ApertusToolParser(tok), ApertusToolParser(tok_1p0)
    assert type(ours) is ApertusToolParser and type(theirs) is VLLMApertus
    # on the 1.0 output format the chosen parser is vLLM's, answer for answer
    req = request()
    for text in ('Sure. <|tools_prefix|>[{"get_weather": {"city": "Bern"}}]<|tools_suffix|>',
                 '<|tools_prefix|>[{"get_weather": {"city": "Bern"}}, {"get_time": {}}]<|tools_suffix|>',
                 "No call at all."):
        got, want = theirs.extract_tool_calls(text, req), VLLMApertus(tok_1p0).extract_tool_calls(text, req)
        assert got.tools_called == want.tools_called and got.content == want.content
        assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [
            (c.function.name, c.function.arguments) for c in want.tool_calls]


# ---------------------------------------------------------------- structured outputs and the reasoning parser
@pytest.fixture(scope="module")
def chat(tok):
    from apertus_plugins.core.chat import ChatTokenizer

    return ChatTokenizer(tok.backend_tokenizer, VocabSpec.scaled())


def _prompt(chat, thinking):
    return [int(i) for i in chat.encode_conversation([{"role": "user", "content": "Weather in Lugano?"}],
                                                     add_generation_prompt=True, enable_thinking=thinking).ids]


def test_reasoning_is_over_before_the_first_token_when_thinking_is_off(tok, chat):
    """vLLM's structured outputs (a forced call, tool_choice required, json_object/json_schema) wait for
    ``is_reasoning_end``: it must be true on the prompt itself with thinking off, so the grammar holds
    from the first answer token (the old parser said false on an empty output: ' de{"city": ...}')."""
    from vllm_model.parsers import ApertusReasoningParser

    off, on = _prompt(chat, False), _prompt(chat, True)
    ids = {name: tok.convert_tokens_to_ids(lit) for name, lit in (("open", "<|inner_prefix|>"),
                                                                  ("close", "<|inner_suffix|>"))}
    text = tok.encode("Sunny.", add_special_tokens=False)
    for kwargs in ({}, {"chat_template_kwargs": {}}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert ApertusReasoningParser(tok, **kwargs).is_reasoning_end(off)  # the prompt says disabled
    p = ApertusReasoningParser(tok, chat_template_kwargs={"enable_thinking": True})
    assert not p.is_reasoning_end(on)  # the span may open: not over yet
    assert not p.is_reasoning_end(on + [ids["open"]] + text)
    assert p.is_reasoning_end(on + [ids["open"]] + text + [ids["close"]])  # closed: the grammar starts here
    assert p.is_reasoning_end(on + text)  # no span opened: all answer
    # without a developer block (a raw prompt) the request's flag decides
    bare = tok.encode("<|assistant_start|>", add_special_tokens=False)
    assert ApertusReasoningParser(tok, chat_template_kwargs={}).is_reasoning_end(bare)
    assert not ApertusReasoningParser(tok, chat_template_kwargs={"enable_thinking": True}).is_reasoning_end(bare)


def test_with_thinking_off_the_output_is_all_content_streamed_or_not(parser_cls, tok, chat):
    text = "<|inner_prefix|>x<|inner_suffix|>Plain."
    p = parser_cls(tok, chat_template_kwargs={"enable_thinking": False})
    req = p.adjust_request(request(False))
    assert p.parse(text, req, enable_auto_tools=False)[:2] == (None, text)
    q = parser_cls(tok, chat_template_kwargs={"enable_thinking": False})
    content = ""
    for k, tid in enumerate(ids := tok.encode(text, add_special_tokens=False)):
        msg = q.parse_delta(tok.decode([tid], skip_special_tokens=False), [tid], req,
                            prompt_token_ids=_prompt(chat, False), finished=k == len(ids) - 1)
        assert msg is None or not msg.reasoning
        content += (msg.content or "") if msg else ""
    assert content == text


def test_vllms_per_request_thinking_budget_works_with_the_apertus_reasoning_parser(checkpoint):
    """``thinking_token_budget`` (a request field of this vLLM) needs a reasoning config whose delimiters
    vLLM derives from the reasoning parser: the Apertus 1.5 thinking delimiters, one token each."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    vllm_model.register()
    config = EngineArgs(model=str(checkpoint), dtype="float32", max_model_len=256,
                        reasoning_parser="apertus").create_engine_config()
    reasoning = config.reasoning_config
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|inner_prefix|>", "<|inner_suffix|>"))
    assert reasoning.enabled and reasoning.reasoning_parser == "apertus"
    assert reasoning.reasoning_start_token_ids == [start] and reasoning.reasoning_end_token_ids == [end]
    assert reasoning.natural_reasoning_end_token_ids == [end]
    holder = ThinkingBudgetStateHolder(reasoning, 4, 0, torch.device("cpu"), False)  # what the sampler builds
    assert (holder.think_start_token_ids, holder.think_end_token_ids) == ([start], [end])
    # the request field the server validates it against
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], thinking_token_budget=64)
    assert req.to_sampling_params(128, {}).thinking_token_budget == 64
