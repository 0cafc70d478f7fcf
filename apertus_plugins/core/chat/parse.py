"""Parse what the model generates: the thinking span, tool calls and the visible answer.

Both surface forms of the delimiters are understood (``<|inner_prefix|>``/``<think>`` and
``<|inner_suffix|>``/``</think>``). Tool calls are one JSON array between ``<|tools_prefix|>``
and ``<|tools_suffix|>``; parallel calls are its elements, each a one-key object
``{"NAME": ARGUMENTS}``. Calls may stand inside the thinking span: they are returned as calls
(with ``in_thinking=True``) and removed from the thinking text. A call whose terminator is
missing, the known mis-parse of calls emitted under thinking, is parsed up to the end of the
thinking span (or of the output) and reported in :attr:`ParsedOutput.errors` with
``kind="unterminated"``; if its JSON is complete the call is kept. An unclosed thinking span
makes everything after the opener thinking and leaves the answer empty. Malformed calls never
raise: they become :class:`ToolCallError` entries.

Two readings of one output. :func:`parse_output` and :class:`StreamingParser` read it as a server
must while it is generated: the thinking span is the one the output opens with and it ends at its
first closing delimiter (serving's reasoning/content split, streamed or not). :func:`read_output`
and :func:`visible_answer` read a finished output as every consumer of the answer does (rewards,
judges, evaluation; SPEC.md 7): the answer follows the LAST closing delimiter, an unclosed span
leaves none. The two agree whenever the output holds at most one thinking span, at its start.

Inside a tool call every other delimiter is text of its arguments (``{"q": "<think>"}``, ``"</s>"``):
only ``<|tools_suffix|>`` ends it, or the end of thinking for a call opened inside the thinking
span. :func:`parse_output` and :class:`StreamingParser` read the delimiters the same way.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from apertus_plugins.core.vocab import CHAT_TOKENS

__all__ = ["ParsedOutput", "StreamingParser", "ToolCall", "ToolCallError", "find_markers", "holdback", "parse_output",
           "read_output", "visible_answer", "THINK_OPEN", "THINK_CLOSE", "THINK_DELIMITERS"]

THINK_OPEN = (CHAT_TOKENS["inner_prefix"][0], "<think>")
THINK_CLOSE = (CHAT_TOKENS["inner_suffix"][0], "</think>")
CALL_OPEN = CHAT_TOKENS["tools_prefix"][0]
CALL_CLOSE = CHAT_TOKENS["tools_suffix"][0]
TURN_END = CHAT_TOKENS["assistant_end"][0]
EOS = CHAT_TOKENS["eos"][0]
#: Both surface forms of both thinking delimiters.
THINK_DELIMITERS = THINK_OPEN + THINK_CLOSE
_MARKERS = THINK_DELIMITERS + (CALL_OPEN, CALL_CLOSE, TURN_END, EOS)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    in_thinking: bool = False


@dataclass
class ToolCallError:
    kind: str  # "json", "shape", "unterminated"
    message: str
    text: str


@dataclass
class ParsedOutput:
    thinking: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


_CLOSER = {"[": "]", "{": "}"}


def salvage_json(body: str, final: bool) -> Any:
    """The whole part of a call block cut off before its end (``max_tokens``, a stream not yet done), or None.

    Only what the text proves is kept: the top-level calls whose object closed; and, when ``final`` (the
    generation is over), the open brackets closed where the text stops right after a complete value
    (``[{"get_weather": {"location": "London"}`` -> the call), never a string, number or literal that
    may have been cut (``{"location": "Lon`` or ``{"days": 1`` salvage nothing of that call).
    """
    stack: list[str] = []
    in_string = escaped = False
    last_element = -1  # end of the last top-level array element that closed
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in _CLOSER:
            stack.append(ch)
        elif ch in "]}":
            if not stack or _CLOSER[stack[-1]] != ch:
                return None  # not JSON: nothing to salvage
            stack.pop()
            if len(stack) == 1 and stack[0] == "[":
                last_element = i + 1
    if final and stack and not in_string:
        head = body.rstrip()
        head = head[:-1].rstrip() if head.endswith(",") else head
        if head.endswith(("}", "]", '"')):
            try:
                return json.loads(head + "".join(_CLOSER[b] for b in reversed(stack)))
            except json.JSONDecodeError:
                pass  # a key without its value (`{"location"`): fall back to the whole calls
    if last_element > 0:
        try:
            return json.loads(body[:last_element] + "]")
        except json.JSONDecodeError:
            return None
    return None


def _decode_calls(body: str, in_thinking: bool, calls: list[ToolCall], errors: list[ToolCallError],
                  salvage: bool | None = None) -> None:
    """Decode a call block; ``salvage`` (an unterminated block): False keeps its whole calls, True (the
    generation is over) also closes what :func:`salvage_json` can prove; None decodes the text as it is."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        value = None if salvage is None else salvage_json(body, salvage)
        if value is None:
            errors.append(ToolCallError("json", f"tool call is not valid JSON: {exc}", body))
            return
    if not isinstance(value, list):
        value = [value] if isinstance(value, dict) else value
        if not isinstance(value, list):
            errors.append(ToolCallError("shape", "tool calls must be a JSON array of objects", body))
            return
    for k, item in enumerate(value):
        if not (isinstance(item, dict) and len(item) == 1):
            errors.append(ToolCallError("shape", f"call {k} must be an object with exactly one key (the tool name)",
                                        json.dumps(item, ensure_ascii=False)))
            continue
        (name, args), = item.items()
        if not isinstance(args, dict):
            errors.append(ToolCallError("shape", f"call {k} ({name}): arguments must be an object",
                                        json.dumps(item, ensure_ascii=False)))
            continue
        calls.append(ToolCall(name, args, in_thinking))


def _extract_calls(text: str, in_thinking: bool, calls: list[ToolCall], errors: list[ToolCallError],
                   final: bool = True) -> str:
    """Remove the tool calls from ``text``, collecting them; return the remaining text.

    A call block without its terminator (the last one) is salvaged (:func:`salvage_json`; ``final``: the
    generation is over)."""
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:
            body = text[body_start:]
            errors.append(ToolCallError("unterminated", "tool call without " + CALL_CLOSE, body))
            head = body.lstrip()
            try:  # a whole array and then text, no terminator: the calls, and the text as text
                _, used = json.JSONDecoder().raw_decode(head)
            except json.JSONDecodeError:
                used = 0
            if used and head[used:].strip():
                _decode_calls(head[:used], in_thinking, calls, errors)
                out.append(head[used:])
            else:
                _decode_calls(body.strip(), in_thinking, calls, errors, salvage=final)
            break
        _decode_calls(text[body_start:end], in_thinking, calls, errors)
        pos = end + len(CALL_CLOSE)
    return "".join(out)


@functools.lru_cache(maxsize=16)
def _pattern(markers: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))


def find_markers(text: str, markers: tuple[str, ...] = _MARKERS, start: int = 0) -> Iterator[tuple[int, str]]:
    """``(position, marker)`` of every one of ``markers`` in ``text`` from ``start``, left to right.

    The one scanner of the output syntax: the parsers, the streaming parser, the template's reading of
    inline thinking spans and the offline pipeline's reasoning stripper all find delimiters with it. At
    one position the longest marker wins; matches do not overlap; linear in the text's length.
    """
    for m in _pattern(tuple(markers)).finditer(text, start):
        yield m.start(), m.group()


def holdback(text: str, markers: tuple[str, ...] = _MARKERS) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers`` (a streamed
    delimiter not yet complete: the part to hold back)."""
    best = 0
    for mk in markers:
        for n in range(min(len(mk) - 1, len(text)), 0, -1):
            if text.endswith(mk[:n]):
                best = max(best, n)
                break
    return best


def _without(text: str, markers: tuple[str, ...]) -> str:
    """``text`` with every one of ``markers`` removed."""
    return _pattern(tuple(markers)).sub("", text)


def _as_text(output: str | Any, tokenizer: Any, who: str, verb: str) -> str:
    """A generation as text: ``output`` itself, or its ids decoded by ``tokenizer``."""
    if isinstance(output, str):
        return output
    if tokenizer is None:
        raise ValueError(f"{who}: a tokenizer is needed to {verb} ids")
    return tokenizer.decode([int(i) for i in output])


def _layout(text: str) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
    """Where the output ends and the thinking span opens and closes, as :class:`StreamingParser` reads them.

    Returns ``(end, (open_start, open_end) or None, (close_start, close_end) or None)``.
    """
    mode, call_in_thinking = "content", False
    opened: tuple[int, int] | None = None
    closed: tuple[int, int] | None = None
    for i, mk in find_markers(text):
        if mode == "call":
            if mk == CALL_CLOSE:
                mode = "reasoning" if call_in_thinking else "content"
            elif mk in THINK_CLOSE and call_in_thinking:
                mode, closed = "content", (i, i + len(mk))
            continue  # any other delimiter is text of the call
        if mk in (TURN_END, EOS):
            return i, opened, closed
        if mk in THINK_OPEN and mode == "content" and opened is None:
            mode, opened = "reasoning", (i, i + len(mk))
        elif mk in THINK_CLOSE and mode == "reasoning":
            mode, closed = "content", (i, i + len(mk))
        elif mk == CALL_OPEN:
            mode, call_in_thinking = "call", mode == "reasoning"
    return len(text), opened, closed


def parse_output(output: str | Any, tokenizer: Any = None, *, final: bool = True) -> ParsedOutput:
    """Parse a generation given as text or as ids (then ``tokenizer`` decodes them).

    ``final=False`` parses a generation still under way (a stream): of a call block cut off at the end,
    only the calls whose object closed are taken, never arguments that may still grow."""
    output = _as_text(output, tokenizer, "parse_output", "parse")
    end, opened, closed = _layout(output)
    text = output[:end]
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    thinking: str | None = None
    before = text
    after = ""
    if opened:
        before = text[: opened[0]]
        inner = text[opened[1]: end if closed is None else closed[0]]
        thinking = _extract_calls(inner, True, calls, errors, final)
        after = "" if closed is None else text[closed[1]:]
    content = _extract_calls(before, False, calls, errors, final) + _extract_calls(after, False, calls, errors, final)
    if opened and closed is None:
        content = ""
    return ParsedOutput(thinking=thinking, content=content, tool_calls=calls, errors=errors)


def _reader_layout(text: str) -> tuple[int, tuple[int, int] | None, int | None]:
    """Where the output ends, where the last thinking span closes, and where an unclosed span opens.

    Delimiters inside a tool call are text of the call, except that a closing thinking delimiter
    ends a call opened inside the span (its terminator missing), as for :func:`parse_output`.
    Returns ``(end, (close_start, close_end) or None, open_end or None)``: the last closing
    delimiter (with or without an opener before it), and the end of an opener after it that is
    never closed.
    """
    mode, call_in_thinking = "content", False
    closed: tuple[int, int] | None = None
    opened: int | None = None
    for i, mk in find_markers(text):
        if mode == "call":
            if mk == CALL_CLOSE:
                mode = "content"
            elif mk in THINK_CLOSE and call_in_thinking:
                mode, closed, opened = "content", (i, i + len(mk)), None
            continue
        if mk in (TURN_END, EOS):
            return i, closed, opened
        if mk in THINK_CLOSE:
            closed, opened = (i, i + len(mk)), None
        elif mk in THINK_OPEN and opened is None:
            opened = i + len(mk)
        elif mk == CALL_OPEN:
            mode, call_in_thinking = "call", opened is not None
    return len(text), closed, opened


def read_output(output: str | Any, tokenizer: Any = None) -> ParsedOutput:
    """What a reader of a finished generation sees: the one rule of rewards, judges and evaluation.

    The answer is what follows the LAST closing thinking delimiter (either surface form, with or
    without an opener before it: the opener may have been part of the prompt); a thinking span
    opened and never closed leaves no answer (SPEC.md 7). Everything before the last closer is
    thinking, its delimiters removed. Tool calls are taken out of both; ``in_thinking`` says on
    which side of the last closer each one stands. Text after the end of the turn is dropped.

    :func:`parse_output` and :class:`StreamingParser` read the output as a server must while it is
    generated: the thinking span is the one the output opens with, and it ends at its first
    closing delimiter (a stream cannot wait for a later one). They agree with this function
    whenever the output holds at most one thinking span, at its start.
    """
    output = _as_text(output, tokenizer, "read_output", "read")
    end, closed, opened = _reader_layout(output)
    text = output[:end]
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    thinking: str | None = None
    answer = text
    if closed is not None:
        thinking = _without(_extract_calls(text[: closed[0]], True, calls, errors), THINK_DELIMITERS)
        answer = text[closed[1]:]
    if opened is not None:  # a span opened after the answer began and never closed: no answer
        at = opened - (0 if closed is None else closed[1])
        before = answer[:at]
        before = before[: len(before) - max(len(m) for m in THINK_OPEN if before.endswith(m))]
        _extract_calls(before, False, calls, errors)
        tail = _extract_calls(answer[at:], True, calls, errors)
        return ParsedOutput(thinking=(thinking or "") + tail, content="", tool_calls=calls, errors=errors)
    content = _extract_calls(answer, False, calls, errors)
    return ParsedOutput(thinking=thinking, content=content, tool_calls=calls, errors=errors)


def visible_answer(output: str | Any, tokenizer: Any = None) -> str:
    """The answer a reader sees (:func:`read_output`), tool calls removed, outer whitespace stripped."""
    return read_output(output, tokenizer).content.strip()


class StreamingParser:
    """Incremental parsing for streaming: feed text deltas, get reasoning/content deltas and calls.

    ``feed`` returns a list of events ``("reasoning", text)``, ``("content", text)`` and
    ``("tool_calls", [ToolCall, ...])``; a delimiter split across deltas is held back until it is
    complete. Concatenating the events gives the same result as :func:`parse_output` on the whole.
    """

    _MARKERS = _MARKERS

    def __init__(self) -> None:
        self._pending = ""
        self._mode = "content"  # "content", "reasoning", "call"
        self._call_buf = ""
        self._call_in_thinking = False
        self._done = False
        self.errors: list[ToolCallError] = []
        self._seen_think = False

    def _holdback(self, text: str) -> int:
        return holdback(text, self._MARKERS)

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._done:
            return events
        text = self._pending + delta
        self._pending = ""
        while text:
            hit = next(find_markers(text, self._MARKERS), None)
            if hit is None:
                keep = 0 if final else self._holdback(text)
                self._emit(text[: len(text) - keep], events)
                self._pending = text[len(text) - keep:]
                break
            pos, mk = hit
            self._emit(text[:pos], events)
            text = text[pos + len(mk):]
            if mk in (TURN_END, EOS) and self._mode != "call":
                self._done = True
                break
            self._transition(mk, events)
        if final:
            self.finish(events)
        return events

    def _emit(self, text: str, events: list[tuple[str, Any]]) -> None:
        if not text:
            return
        if self._mode == "call":
            self._call_buf += text
        else:
            events.append((self._mode, text))

    def _transition(self, mk: str, events: list[tuple[str, Any]]) -> None:
        if self._mode == "call":
            if mk == CALL_CLOSE:
                self._close_call(events)
            elif mk in THINK_CLOSE and self._call_in_thinking:
                self.errors.append(ToolCallError("unterminated", "tool call without " + CALL_CLOSE, self._call_buf))
                self._close_call(events, record=False)
                self._mode = "content"
            else:
                self._call_buf += mk
            return
        if mk in THINK_OPEN and self._mode == "content" and not self._seen_think:
            self._mode = "reasoning"
            self._seen_think = True
        elif mk in THINK_CLOSE and self._mode == "reasoning":
            self._mode = "content"
        elif mk == CALL_OPEN:
            self._call_in_thinking = self._mode == "reasoning"
            self._mode = "call"
            self._call_buf = ""
        else:
            events.append((self._mode, mk))

    def _close_call(self, events: list[tuple[str, Any]], record: bool = True) -> None:
        calls: list[ToolCall] = []
        _decode_calls(self._call_buf.strip() if not record else self._call_buf, self._call_in_thinking,
                      calls, self.errors, salvage=None if record else True)
        if calls:
            events.append(("tool_calls", calls))
        self._mode = "reasoning" if self._call_in_thinking else "content"
        self._call_buf = ""

    def finish(self, events: list[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
        """Flush at the end of the stream (an open call is parsed and reported unterminated)."""
        events = [] if events is None else events
        if self._pending:
            self._emit(self._pending, events)
            self._pending = ""
        if self._mode == "call":
            self.errors.append(ToolCallError("unterminated", "tool call without " + CALL_CLOSE, self._call_buf))
            self._close_call(events, record=False)
        self._done = True
        return events
