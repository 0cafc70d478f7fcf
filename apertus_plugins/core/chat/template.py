"""The Apertus 1.5 chat template, in two variants, from one Jinja source.

The template renders the bytes of the released (canonical) Apertus 1.5 chat template for every
conversation that template accepts (checked in the core suite against renders of the released
template, ``tests/core/data/chat_canonical.json``). ``inference`` inserts the default system
prompt when the conversation has none; ``training`` renders an explicit empty system block, so
no user-controlled text can occupy the system slot. :func:`jinja_template` returns the source
for a Hugging Face ``chat_template``; :func:`render` renders from Python through the same source
after :func:`normalize_messages` has checked the messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from apertus_plugins.core.vocab import VocabSpec, default_spec

from .parse import THINK_CLOSE, THINK_DELIMITERS, THINK_OPEN, find_markers

__all__ = ["VARIANTS", "MAX_NESTING", "REASONING_PARTS", "ChatFormatError", "RenderOptions", "compile_template",
           "jinja_template",
           "lift_reasoning_parts", "media_placeholders", "normalize_messages", "normalize_tools",
           "reasoning_as_blocks", "render"]

VARIANTS = ("inference", "training")
TEXT_PARTS = ("text",)
ROLES = ("system", "user", "assistant", "tool")
BLOCKS = ("thoughts", "response", "tool_calls", "tool_outputs")
#: Assistant content parts that carry a previous turn's reasoning (OpenAI-style ``thinking`` parts,
#: Anthropic's ``redacted_thinking``): reasoning, never answer text (:func:`lift_reasoning_parts`).
REASONING_PARTS = ("thinking", "redacted_thinking", "reasoning")
#: The deepest nesting of lists and mappings a conversation or its tools may have (a tool schema
#: nested 200 levels deep otherwise exhausts the renderer's recursion). A JSON schema level takes
#: two (the schema and its ``properties``): about 45 schema levels under a tool.
MAX_NESTING = 100
#: The template flags, which must be booleans (a string ``"false"`` would be true in the template).
FLAGS = ("add_generation_prompt", "enable_thinking", "continue_assistant_message")


class ChatFormatError(ValueError):
    """A conversation the chat format cannot render; the message names the message index."""


@cache
def _source() -> str:
    return (resources.files(__package__) / "apertus1p5.jinja").read_text(encoding="utf-8")


def media_placeholders(spec: VocabSpec | None = None) -> dict[str, str]:
    """Content-part type -> placeholder literal of every modality of ``spec`` (default: the released
    layout: ``image``, ``image_url`` and ``input_image`` -> ``<|image|>``, ``audio``, ``audio_url`` and
    ``input_audio`` -> ``<|audio|>``; a spec from :func:`apertus_plugins.plugins.spec` adds the
    registered modalities')."""
    return (spec or default_spec()).media_placeholders()


def jinja_template(variant: str = "inference", spec: VocabSpec | None = None) -> str:
    """The Jinja source of the chat template, for ``tokenizer.chat_template``.

    Its first line sets the media part types and their placeholders from ``spec``
    (:func:`media_placeholders`), so a checkpoint written with a plugin's spec renders that
    modality's parts too.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown template variant {variant!r}; variants are {', '.join(VARIANTS)}")
    media = "{%- set apertus_media = " + json.dumps(media_placeholders(spec), ensure_ascii=False) + " -%}\n"
    if variant == "training":
        return "{%- set apertus_training_variant = true -%}\n" + media + _source()
    return media + _source()


@dataclass(frozen=True)
class RenderOptions:
    """How a conversation is rendered: the template's three flags, the variant, the BOS literal, another template.

    The one statement of the render parameters: :func:`render`, :func:`render_normalized` and
    :meth:`ChatTokenizer.encode_conversation <apertus_plugins.core.chat.ChatTokenizer.encode_conversation>`
    take an ``options`` object or the same fields as keywords.

    Attributes:
        add_generation_prompt: end with an open assistant turn.
        enable_thinking: the thinking flag of the template (a boolean: a string ``"false"`` is refused).
        continue_assistant_message: leave the last assistant message open.
        variant: ``inference`` (the default system prompt) or ``training`` (an explicit empty system block).
        bos_token: the BOS literal the template writes first.
        template: another template source (a checkpoint's) instead of ``variant``'s.
    """

    add_generation_prompt: bool = False
    enable_thinking: bool = False
    continue_assistant_message: bool = False
    variant: str = "inference"
    bos_token: str = "<s>"
    template: str | None = None

    def __post_init__(self) -> None:
        for flag in FLAGS:
            value = getattr(self, flag)
            if not isinstance(value, (bool, np.bool_)):
                raise ChatFormatError(f"{flag} must be true or false, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, flag, bool(value))
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown template variant {self.variant!r}; variants are {', '.join(VARIANTS)}")

    @classmethod
    def of(cls, options: RenderOptions | None = None, **fields: Any) -> RenderOptions:
        """``options`` (default: the defaults) with ``fields`` replacing its values; an unknown name is a
        ``TypeError`` naming it."""
        base = options or cls()
        return replace(base, **fields) if fields else base


def _raise(message: str) -> None:
    raise ChatFormatError(message)


@cache
def compile_template(source: str) -> Any:
    """Compile a chat template source as ``transformers`` does for ``apply_chat_template``.

    A sandboxed environment with ``trim_blocks``/``lstrip_blocks``, the loop controls, the
    ``tojson`` filter and ``raise_exception``; used for this package's template and for the one a
    checkpoint ships (``apertus doctor``).
    """
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    # the same filter and global transformers installs for chat templates
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _check_parts(parts: Any, where: str, text_only: bool, placeholders: Mapping[str, str]) -> None:
    for k, part in enumerate(parts):
        if isinstance(part, str):
            continue
        if not isinstance(part, dict) or "type" not in part:
            raise ChatFormatError(f"{where}, part {k}: a content part must be a mapping with a 'type', got {part!r:.80}")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}, part {k}: a text part needs a string 'text'")
        elif text_only:
            raise ChatFormatError(f"{where}, part {k}: only text parts can stand here, got {kind!r}")
        elif kind not in placeholders:
            raise ChatFormatError(
                f"{where}, part {k}: unknown content part type {kind!r} (expected one of "
                f"{', '.join(TEXT_PARTS + tuple(placeholders))})")


def _text_of(parts: list[Any]) -> str:
    return "".join(p if isinstance(p, str) else p["text"] for p in parts)


def _nesting(obj: Any) -> int:
    """The depth of nested lists and mappings in ``obj`` (a string or number is 0), without recursion."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            items: Any = o.values()
        elif isinstance(o, (list, tuple)):
            items = o
        else:
            continue
        deepest = max(deepest, d)
        if d > MAX_NESTING:
            return d
        stack.extend((x, d + 1) for x in items)
    return deepest


def _check_nesting(obj: Any, where: str) -> None:
    if _nesting(obj) > MAX_NESTING:
        raise ChatFormatError(f"{where}: nested more than {MAX_NESTING} levels of lists and mappings deep")


def _reasoning_text(part: dict[str, Any]) -> str:
    for key in ("thinking", "text", "reasoning", "data"):
        if isinstance(part.get(key), str):
            return part[key]
    return ""


def lift_reasoning_parts(messages: Any) -> Any:
    """Assistant messages whose content parts carry reasoning (:data:`REASONING_PARTS`), with those
    parts moved out of the content into ``reasoning_content`` (joined; an existing
    ``reasoning_content`` or ``reasoning`` is kept). Other messages are returned as they are.

    A previous turn's reasoning is rendered only as the released template renders reasoning: from
    ``thoughts`` blocks (:func:`reasoning_as_blocks`); in the string form it is dropped, as the
    released template drops ``reasoning_content``. It never becomes answer text. A server applies
    this before its own message parsing flattens the parts into text (``vllm_model.renderer``).
    """
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and m.get("role") == "assistant" and isinstance(c, list)
                and any(isinstance(p, dict) and p.get("type") in REASONING_PARTS for p in c)):
            out.append(m)
            continue
        thoughts = [_reasoning_text(p) for p in c if isinstance(p, dict) and p.get("type") in REASONING_PARTS]
        m = {**m, "content": [p for p in c if not (isinstance(p, dict) and p.get("type") in REASONING_PARTS)]}
        if not (m.get("reasoning_content") or m.get("reasoning")):
            m["reasoning_content"] = "".join(thoughts)
        out.append(m)
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check the tool declarations' shape: ``None`` or a list of mappings, nested at most
    :data:`MAX_NESTING` deep. (The template checks names, descriptions and schemas and names the tool.)"""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatFormatError(f"tools must be a list of tool declarations, got {type(tools).__name__}")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatFormatError(f"tool {k}: a tool must be a mapping, got {type(tool).__name__}")
        _check_nesting(tool, f"tool {k}")
    return tools


def normalize_messages(messages: list[dict[str, Any]], spec: VocabSpec | None = None) -> list[dict[str, Any]]:
    """Check the messages and return them in the shape the released template renders.

    The released (canonical) shapes pass unchanged: string contents, user content as
    ``{"parts": [...]}`` (``text`` parts and the media part types of ``spec``'s modalities:
    :func:`media_placeholders`), assistant content as a string or as
    ``{"blocks": [...]}`` (``thoughts``, ``response``, ``tool_calls``, ``tool_outputs``), tool calls
    with JSON-string arguments. OpenAI-style lists of parts become the canonical shape (user:
    ``{"parts": ...}``; system, assistant and tool: their text joined); tool-call arguments given
    as an object are kept (the template writes them as JSON). ``reasoning_content`` is ignored, as
    by the released template: thinking is rendered from ``thoughts`` blocks
    (:func:`reasoning_as_blocks` converts); assistant reasoning parts (``thinking``...) are
    reasoning, not answer text (:func:`lift_reasoning_parts`). Raises :class:`ChatFormatError` naming the message for
    what the format rejects: a non-mapping message, an unknown role, a system message that is not
    first, a tool message outside an assistant turn, an unknown part or block type, malformed tool
    calls, tool-output blocks whose entries are not ``{"output": ...}`` (the released template
    would silently render those empty), and messages nested deeper than :data:`MAX_NESTING`.
    """
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list")
    placeholders = media_placeholders(spec)
    messages = lift_reasoning_parts(messages)
    out: list[dict[str, Any]] = []
    in_turn = False
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict) or "role" not in m:
            raise ChatFormatError(f"{where}: a message must be a mapping with a 'role'")
        role = m["role"]
        if role not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        _check_nesting(m, where)
        m = dict(m)
        c = m.get("content")
        if role == "system" and i != 0:
            raise ChatFormatError(f"{where}: a system message may only be the first message")
        if isinstance(c, list):
            _check_parts(c, where, role != "user", placeholders)
            m["content"] = {"parts": c} if role == "user" else _text_of(c)
        elif role == "user" and isinstance(c, dict) and "parts" in c:
            _check_parts(c["parts"], where, False, placeholders)
        if role == "user":
            in_turn = False
        elif role == "assistant":
            in_turn = True
            _check_assistant(m, where)
        elif role == "tool" and not in_turn:
            raise ChatFormatError(f"{where}: a tool message must follow an assistant message")
        out.append(m)
    return out


def _check_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}: tool calls must be a list")
    for k, call in enumerate(calls):
        fn = call.get("function") or call if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"{where}, call {k}: a tool call needs a string name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError as exc:
                raise ChatFormatError(f"{where}, call {k} ({fn['name']}): arguments are not JSON ({exc})") from exc
            except RecursionError:
                raise ChatFormatError(f"{where}, call {k} ({fn['name']}): arguments nested too deeply") from None
        elif not isinstance(args, dict):
            raise ChatFormatError(f"{where}, call {k} ({fn['name']}): arguments must be a JSON string or an object")


def _check_assistant(m: dict[str, Any], where: str) -> None:
    c = m.get("content")
    if isinstance(c, dict) and "blocks" in c:
        for k, b in enumerate(c["blocks"]):
            bwhere = f"{where}, block {k}"
            if not isinstance(b, dict) or b.get("type") not in BLOCKS:
                raise ChatFormatError(f"{bwhere}: unknown assistant block {b!r:.80} (types are {', '.join(BLOCKS)})")
            if b["type"] == "tool_calls":
                _check_calls(b.get("calls"), bwhere)
            elif b["type"] == "tool_outputs":
                outs = b.get("outputs")
                if not isinstance(outs, list) or not all(isinstance(o, dict) and "output" in o for o in outs):
                    raise ChatFormatError(f"{bwhere}: tool outputs must be a list of {{\"output\": ...}} mappings")
    if m.get("tool_calls"):
        _check_calls(m["tool_calls"], f"{where}, tool_calls")


def _inline_blocks(text: str) -> list[dict[str, Any]]:
    """Assistant text with thinking spans written into it, as ``thoughts`` and ``response`` blocks.

    A span opens at ``<|inner_prefix|>`` or ``<think>`` and closes at ``<|inner_suffix|>`` or
    ``</think>`` (an unclosed span runs to the end); a closing delimiter outside a span and an
    opening one inside a span stay text. The blocks render the delimiters the text held, as ids.
    """
    blocks: list[dict[str, Any]] = []
    inside, closed, cur, pos = False, False, "", 0
    for at, lit in find_markers(text, THINK_DELIMITERS):
        cur += text[pos:at]
        pos = at + len(lit)
        if not inside and lit in THINK_OPEN:
            if cur or closed:  # a response, or the empty one that closes the span before
                blocks.append({"type": "response", "text": cur})
            inside, closed, cur = True, False, ""
        elif inside and lit in THINK_CLOSE:
            blocks.append({"type": "thoughts", "text": cur})
            inside, closed, cur = False, True, ""
        else:
            cur += lit
    cur += text[pos:]
    if inside:
        blocks.append({"type": "thoughts", "text": cur})
    elif cur or closed:
        blocks.append({"type": "response", "text": cur})
    return blocks


def reasoning_as_blocks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training data's reasoning, in any of its forms, as the canonical blocks form.

    The released template renders thinking only from ``thoughts`` blocks (it ignores
    ``reasoning_content``; thinking delimiters written in assistant text are text, as any text),
    and a conversation uses one assistant form throughout. So when any assistant message carries
    ``reasoning_content`` (or ``reasoning``, or reasoning parts: :func:`lift_reasoning_parts`) or a
    thinking span written into its text (``<think>…</think>`` or
    ``<|inner_prefix|>…<|inner_suffix|>``, :func:`_inline_blocks`), every assistant message in
    string form becomes ``{"blocks": [thoughts, response, ..., tool_calls]}`` (the blocks it has),
    tool calls as ``{"name", "arguments"}`` with JSON-string arguments. Other conversations are
    returned unchanged. Used for SFT data (``apertus tokenize sft``); a server never applies it to
    a request's history, whose text stays text.
    """
    def reasoning(m: dict[str, Any]) -> Any:
        return m.get("reasoning_content") or m.get("reasoning")

    def text_of(c: Any) -> str:
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return "".join(p if isinstance(p, str) else p.get("text", "") if isinstance(p, dict) else "" for p in c)
        return ""

    lifted = lift_reasoning_parts(messages)
    if not isinstance(lifted, list) or not any(
            isinstance(m, dict) and m.get("role") == "assistant"
            and (reasoning(m) or any(o in text_of(m.get("content")) for o in THINK_OPEN)) for m in lifted):
        return messages
    out = []
    for m in normalize_messages(lifted):
        c = m.get("content")
        if m["role"] != "assistant" or not isinstance(c, str):
            out.append(m)
            continue
        blocks: list[dict[str, Any]] = []
        if reasoning(m):
            blocks.append({"type": "thoughts", "text": reasoning(m)})
        if c:
            blocks.extend(_inline_blocks(c))
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") or call
                args = fn.get("arguments", {})
                calls.append({"name": fn["name"],
                              "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
            blocks.append({"type": "tool_calls", "calls": calls})
        rest = {k: v for k, v in m.items() if k not in ("content", "reasoning_content", "reasoning", "tool_calls")}
        out.append({**rest, "content": {"blocks": blocks}})
    return out


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           options: RenderOptions | None = None, *, spec: VocabSpec | None = None, **fields: Any) -> str:
    """Render a conversation to the exact string the model was trained on.

    ``options`` (or its fields as keywords: ``add_generation_prompt=True``...) says how
    (:class:`RenderOptions`); ``spec`` whose modalities' parts the conversation may carry (default:
    the released layout's image and audio).
    """
    opts = RenderOptions.of(options, **fields)
    return render_normalized(normalize_messages(messages, spec), normalize_tools(tools), opts, spec=spec)


def render_normalized(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      options: RenderOptions | None = None, *, spec: VocabSpec | None = None,
                      marks: str | None = None, **fields: Any) -> str:
    """Render messages that :func:`normalize_messages` has already checked (the arguments of :func:`render`).

    ``marks``: the private-use characters :class:`~apertus_plugins.core.chat.ChatTokenizer` wrapped the
    request's text in (the template ignores them where it measures or compares a string).
    """
    from jinja2 import TemplateError

    opts = RenderOptions.of(options, **fields)
    source = opts.template if opts.template is not None else jinja_template(opts.variant, spec)
    extra = {} if marks is None else {"apertus_marks": marks}
    try:
        return compile_template(source).render(
            messages=msgs,
            tools=tools or None,
            add_generation_prompt=opts.add_generation_prompt,
            enable_thinking=opts.enable_thinking,
            continue_assistant_message=opts.continue_assistant_message,
            bos_token=opts.bos_token,
            **extra,
        )
    except ChatFormatError:
        raise
    except (TemplateError, TypeError, ValueError) as exc:
        raise ChatFormatError(f"the conversation cannot be rendered: {type(exc).__name__}: {exc}") from exc
