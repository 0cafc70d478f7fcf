"""The ``apertus`` tool parser and ``apertus`` reasoning parser: thin vLLM wrappers over the core.

The Apertus 1.5 output format (SPEC.md 3.5) is parsed by :func:`apertus_plugins.core.chat.parse_output`:
the thinking span in both surface forms (``<|inner_prefix|>``/``<think>``,
``<|inner_suffix|>``/``</think>``), tool calls as one JSON array between ``<|tools_prefix|>`` and
``<|tools_suffix|>`` (parallel calls are its elements), calls inside the thinking span, and calls
whose terminator is missing. The last case is what a server sees whenever a call ends the
generation: ``<|tools_suffix|>`` is a stop token, and vLLM leaves stop tokens out of the text.

vLLM runs the reasoning parser first and gives the tool parser what follows the reasoning. So
that calls made inside the thinking span reach the tool parser, the reasoning parser ends the
reasoning at such a call: non-streaming, it moves the calls out of the thinking text into the
content; streaming, the reasoning phase ends where the call begins.

Structured outputs (a forced tool call, ``tool_choice: "required"``, ``response_format``
``json_object``/``json_schema``) apply once :meth:`ApertusReasoningParser.is_reasoning_end` says
the reasoning is over. With thinking off (the prompt's developer block says ``Deliberation:
disabled``, or the request's ``enable_thinking`` is false) there is no reasoning: it is over before
the first generated token, so the grammar holds from the first answer token. With thinking on it
is over once the span has closed (or a call began in it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.reasoning import ReasoningParser
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tool_parsers import ToolParser

from apertus_plugins.core.chat import parse_output
from apertus_plugins.core.chat.parse import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, find_markers, holdback
from apertus_plugins.core.vocab import CHAT_TOKENS, default_spec

__all__ = ["ApertusReasoningParser", "ApertusToolParser", "is_apertus_1p5_tokenizer", "render_calls"]

_MARKERS = THINK_OPEN + THINK_CLOSE + (CALL_OPEN, CALL_CLOSE)


def render_calls(calls: Sequence[Any]) -> str:
    """Calls (``ToolCall`` of the core) as one call block in the output format."""
    body = json.dumps([{c.name: c.arguments} for c in calls], ensure_ascii=False)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def _at_token_limit(request: Any, token_ids: Sequence[int]) -> bool:
    """Whether ``token_ids`` (the generation so far) reached the request's ``max_tokens``: the last delta."""
    limit = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
    return bool(limit) and len(token_ids) >= int(limit)


def _holdback(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a delimiter."""
    return holdback(text, _MARKERS)


def _token_id(tokenizer: Any, name: str) -> int:
    literal = CHAT_TOKENS[name][0]
    vocab = tokenizer.get_vocab()
    if literal not in vocab:
        raise ValueError(f"the tokenizer has no {literal!r} token; the apertus parsers need the Apertus 1.5 tokenizer")
    return int(vocab[literal])


def is_apertus_1p5_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has the Apertus 1.5 layout (its image and audio markers), not Apertus 1.0's."""
    unk = getattr(tokenizer, "unk_token_id", None)
    spec = default_spec()
    for name in ("img_start", "audio_start"):
        tid = tokenizer.convert_tokens_to_ids(spec.literal(name))
        if tid is None or tid == unk:
            return False
    return True


class ApertusReasoningParser(ReasoningParser):
    """Separates the thinking span ``<|inner_prefix|>…<|inner_suffix|>`` (or ``<think>…</think>``).

    The thinking span is the one the output opens with; without it the whole output is content.
    With thinking off for the request there is no reasoning at all: the whole output is content,
    streamed or not, and structured outputs apply from the first token. Reasoning ends at the
    closing delimiter or at a tool call made inside the span (see the module docstring).
    """

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.start_id = _token_id(tokenizer, "inner_prefix")
        self.end_id = _token_id(tokenizer, "inner_suffix")
        self.call_id = _token_id(tokenizer, "tools_prefix")
        self.turn_start_id = _token_id(tokenizer, "assistant_start")
        self.developer_start_id = _token_id(tokenizer, "developer_start")
        self.developer_end_id = _token_id(tokenizer, "developer_end")
        template_kwargs = kwargs.get("chat_template_kwargs")
        #: the request's thinking flag when the server handed its template kwargs over (vLLM does, per
        #: request; the template's default is off); ``None`` when unknown
        self.request_thinking: bool | None = None
        if isinstance(template_kwargs, dict):
            flag = template_kwargs.get("enable_thinking", False)
            self.request_thinking = flag if isinstance(flag, bool) else None
        self._cache_ids: list[int] = []
        self._cache_text = ""
        self._thinking_cache: tuple[tuple[int, ...], bool] | None = None

    @property
    def reasoning_start_str(self) -> str:
        return THINK_OPEN[0]

    @property
    def reasoning_end_str(self) -> str:
        return THINK_CLOSE[0]

    def _generated_text(self, input_ids: Sequence[int]) -> str:
        """The text generated after the last ``<|assistant_start|>`` (all of ``input_ids`` without one)."""
        ids = [int(i) for i in input_ids]
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] == self.turn_start_id:
                ids = ids[k + 1:]
                break
        n = len(self._cache_ids)
        if n and len(ids) >= n and ids[:n] == self._cache_ids:
            text = self._cache_text + self.model_tokenizer.decode(ids[n:], skip_special_tokens=False)
        else:
            text = self.model_tokenizer.decode(ids, skip_special_tokens=False)
        self._cache_ids, self._cache_text = ids, text
        return text

    def thinking_enabled(self, input_ids: Sequence[int]) -> bool | None:
        """Whether the conversation in ``input_ids`` deliberates: its last developer block says
        ``Deliberation: enabled`` (the template's first line there); without a developer block, the
        request's ``enable_thinking``; ``None`` when neither is known."""
        ids = [int(i) for i in input_ids]
        try:
            end = len(ids) - 1 - ids[::-1].index(self.developer_end_id)
            start = end - ids[end::-1].index(self.developer_start_id)
        except ValueError:
            return self.request_thinking
        block = tuple(ids[start + 1:end])
        if self._thinking_cache is None or self._thinking_cache[0] != block:
            text = self.model_tokenizer.decode(list(block), skip_special_tokens=False)
            self._thinking_cache = (block, text.startswith("Deliberation: enabled"))
        return self._thinking_cache[1]

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over: thinking is off (there is none), no thinking span opens the
        answer, the span closed, or a call began in it. ``input_ids`` is the prompt, or the prompt and
        what was generated so far."""
        if self.thinking_enabled(input_ids) is False:
            return True
        return self._split(self._generated_text(input_ids), final=False)[1] is not None

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Any) -> bool:
        return self.is_reasoning_end(input_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        ids = list(input_ids)
        for k, tid in enumerate(ids):
            if tid == self.end_id:
                return ids[k + 1:]
            if tid == self.call_id:
                return ids[k:]
        return [] if ids and ids[0] == self.start_id else ids

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids)
        if not ids or ids[0] != self.start_id:
            return 0
        for k, tid in enumerate(ids[1:], start=1):
            if tid in (self.end_id, self.call_id):
                return k - 1
        return len(ids) - 1

    @staticmethod
    def _split(text: str, final: bool) -> tuple[str | None, str | None]:
        """(thinking so far, content) of a streamed text; content is None while thinking goes on."""
        opener = next((o for o in THINK_OPEN if text.startswith(o)), None)
        if opener is None:
            if not final and any(o.startswith(text) for o in THINK_OPEN):
                return None, None  # may still become an opener
            return None, text
        rest = text[len(opener):]
        end = next(find_markers(rest, THINK_CLOSE + (CALL_OPEN,)), None)
        if end is not None:
            pos, mk = end
            return rest[:pos], rest[pos + len(mk):] if mk in THINK_CLOSE else rest[pos:]
        keep = 0 if final else _holdback(rest)
        return rest[: len(rest) - keep], None

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if self.request_thinking is False:  # no reasoning with thinking off, streamed or not (see is_reasoning_end)
            return None, model_output
        parsed = parse_output(model_output)
        if parsed.thinking is None:
            return None, model_output
        reasoning, after = self._split(model_output, final=True)
        thinking_calls = [c for c in parsed.tool_calls if c.in_thinking]
        if not thinking_calls:
            return reasoning, after or None
        # calls inside the thinking span: the thinking text without them; the calls, then what follows
        # the span, for the tool parser
        closes = [model_output.find(c) + len(c) for c in THINK_CLOSE if c in model_output]
        tail = model_output[min(closes):] if closes else ""
        return parsed.thinking, render_calls(thinking_calls) + tail

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        before, _ = self._split(previous_text, final=False)
        now, content = self._split(current_text, final=False)
        reasoning = (now or "")[len(before or ""):] or None
        if reasoning is None and not content:
            return None
        return DeltaMessage(reasoning=reasoning, content=content or None)


class ApertusToolParser(ToolParser):
    """Tool calls of Apertus 1.5: ``<|tools_prefix|>[{"NAME": ARGS}, …]<|tools_suffix|>``.

    Parallel calls are the elements of one array; a call whose terminator is missing (the end of
    the generation, or the thinking span closing) is kept when its JSON is complete, and a block cut
    off by ``max_tokens`` keeps what it proves (:func:`apertus_plugins.core.chat.parse.salvage_json`:
    the calls that closed, and one whose arguments end in a complete value), as vLLM's own
    ``apertus`` parser salvages it. Streaming sends each call whole (name and arguments) as soon as
    its object closes, and salvages a cut-off call on the delta that reaches the token limit.
    """

    supports_required_and_named = True

    def __new__(cls, tokenizer: Any, tools: Any = None) -> Any:
        # `--tool-call-parser apertus` names vLLM's own parser of Apertus 1.0 too: a tokenizer without
        # the 1.5 omni markers (an Apertus 1.0 checkpoint) keeps vLLM's parser
        if cls is ApertusToolParser and not is_apertus_1p5_tokenizer(tokenizer):
            from vllm.tool_parsers.apertus_tool_parser import ApertusToolParser as Apertus1ToolParser

            return Apertus1ToolParser(tokenizer, tools)
        return super().__new__(cls)

    def __init__(self, tokenizer: Any, tools: Any = None) -> None:
        super().__init__(tokenizer, tools)
        _token_id(tokenizer, "tools_prefix")
        self._sent_content = ""
        self._sent_calls = 0

    def adjust_request(self, request: Any) -> Any:
        request = super().adjust_request(request)
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False  # the call delimiters are special tokens
        return request

    @staticmethod
    def _content(text: str, parsed: Any) -> str:
        if parsed.thinking is None:
            return parsed.content
        # no reasoning parser ran: keep the thinking span in the content, calls removed
        closed = any(c in text for c in THINK_CLOSE)
        return THINK_OPEN[0] + parsed.thinking + (THINK_CLOSE[0] if closed else "") + parsed.content

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        parsed = parse_output(model_output)
        calls = [ToolCall(type="function", id=make_tool_call_id(),
                          function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
                 for c in parsed.tool_calls]
        content = self._content(model_output, parsed) if calls else model_output
        content = content.strip() if calls else content
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        # mid-stream only whole calls are sent; on the delta that reaches the request's token limit the
        # generation is over, so a call cut off there is salvaged as the whole output would be
        parsed = parse_output(current_text, final=_at_token_limit(request, current_token_ids))
        content = self._content(current_text, parsed)
        visible = content[: len(content) - _holdback(content)]
        new_content = ""
        if visible.startswith(self._sent_content):
            new_content = visible[len(self._sent_content):]
            self._sent_content = visible
        deltas = []
        for k, call in enumerate(parsed.tool_calls[self._sent_calls:], start=self._sent_calls):
            args = json.dumps(call.arguments, ensure_ascii=False)
            deltas.append(DeltaToolCall(index=k, type="function", id=make_tool_call_id(),
                                        function=DeltaFunctionCall(name=call.name, arguments=args).model_dump(
                                            exclude_none=True)))
            self.prev_tool_call_arr.append({"name": call.name, "arguments": call.arguments})
            self.streamed_args_for_tool.append(args)
        # a call may stop parsing for a moment (a delimiter arriving in pieces): never send one twice
        self._sent_calls = max(self._sent_calls, len(parsed.tool_calls))
        if not deltas and not new_content:
            return None
        return DeltaMessage(content=new_content or None, tool_calls=deltas)
