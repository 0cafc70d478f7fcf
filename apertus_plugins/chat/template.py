"""The Apertus 1.5 chat template, in two variants, from one Jinja source.

``inference`` inserts the default system prompt when the conversation has none; ``training``
renders an explicit empty system block, so no user-controlled text can occupy the system slot.
:func:`jinja_template` returns the source for a Hugging Face ``chat_template``; :func:`render`
renders from Python through the same source after :func:`normalize_messages` has checked the
messages and turned OpenAI-style inputs into the canonical shape.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["VARIANTS", "ChatFormatError", "compile_template", "jinja_template", "normalize_messages", "render"]

VARIANTS = ("inference", "training")
TEXT_PARTS = ("text", "input_text")
IMAGE_PARTS = ("image", "image_url", "input_image")
AUDIO_PARTS = ("audio", "audio_url", "input_audio")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A conversation the chat format cannot render; the message names the message index."""


@cache
def _source() -> str:
    return (resources.files(__package__) / "apertus1p5.jinja").read_text(encoding="utf-8")


def jinja_template(variant: str = "inference") -> str:
    """The Jinja source of the chat template, for ``tokenizer.chat_template``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown template variant {variant!r}; variants are {', '.join(VARIANTS)}")
    if variant == "training":
        return "{%- set apertus_training_variant = true -%}\n" + _source()
    return _source()


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


def _compiled(variant: str) -> Any:
    return compile_template(jinja_template(variant))


def _norm_part(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or "type" not in part:
        raise ChatFormatError(f"{where}: a content part must be a mapping with a 'type', got {part!r:.80}")
    kind = part["type"]
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise ChatFormatError(f"{where}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind in IMAGE_PARTS or kind in AUDIO_PARTS:
        return dict(part)
    raise ChatFormatError(
        f"{where}: unknown content part type {kind!r} (expected one of "
        f"{', '.join(TEXT_PARTS + IMAGE_PARTS + AUDIO_PARTS)})"
    )


def _norm_content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return {"parts": [_norm_part(p, f"{where}, part {k}") for k, p in enumerate(content)]}
    if isinstance(content, dict) and "parts" in content:
        return {"parts": [_norm_part(p, f"{where}, part {k}") for k, p in enumerate(content["parts"])]}
    if isinstance(content, dict) and "blocks" in content:
        return content
    raise ChatFormatError(f"{where}: content must be a string, a list of parts or a mapping with 'parts'")


def _norm_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where}: a tool call needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"{where}: tool call {fn['name']!r} has arguments that are not JSON ({exc})") from exc
    elif not isinstance(args, dict):
        raise ChatFormatError(f"{where}: tool call {fn['name']!r} arguments must be a JSON string or an object")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check the messages and return them in the canonical shape the template renders.

    Accepts OpenAI-style inputs: content as a list of parts (``text``/``input_text``, image parts
    ``image``/``image_url``/``input_image``, audio parts ``audio``/``audio_url``/``input_audio``),
    ``reasoning_content`` (or ``reasoning``) on assistant messages as the thinking span, tool
    calls with arguments as a JSON string or an object. Raises :class:`ChatFormatError` naming the
    message index for an unknown role, a system message that is not first, a tool message that
    does not follow an assistant tool call, an unknown part type or malformed tool-call arguments.
    """
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list")
    out: list[dict[str, Any]] = []
    waiting = False  # an assistant tool call is waiting for its outputs
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict) or "role" not in m:
            raise ChatFormatError(f"{where}: a message must be a mapping with a 'role'")
        role = m["role"]
        if role not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if role == "system":
            if i != 0:
                raise ChatFormatError(f"{where}: a system message may only be the first message")
            c = m.get("content")
            if isinstance(c, dict) and isinstance(c.get("text"), str):
                out.append({"role": "system", "content": c["text"]})
            elif isinstance(c, str):
                out.append({"role": "system", "content": c})
            elif isinstance(c, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in c):
                out.append({"role": "system", "content": "".join(p["text"] for p in c)})
            else:
                raise ChatFormatError(f"{where}: system content must be a string or a mapping with 'text'")
            continue
        if role == "tool":
            if not waiting:
                raise ChatFormatError(f"{where}: a tool message must follow an assistant message with tool calls")
            content = _norm_content(m.get("content"), where)
            out.append({"role": "tool", "content": content})
            continue
        if role == "user":
            waiting = False
            out.append({"role": "user", "content": _norm_content(m.get("content"), where)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": _norm_content(m.get("content"), where)}
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning:
            if not isinstance(reasoning, str):
                raise ChatFormatError(f"{where}: reasoning_content must be a string")
            msg["reasoning_content"] = reasoning
        calls = m.get("tool_calls") or []
        if calls:
            msg["tool_calls"] = [_norm_call(c, f"{where}, tool call {k}") for k, c in enumerate(calls)]
        if isinstance(msg["content"], dict) and "blocks" in msg["content"]:
            for k, b in enumerate(msg["content"]["blocks"]):
                if not isinstance(b, dict) or b.get("type") not in ("thoughts", "response", "tool_calls", "tool_outputs"):
                    raise ChatFormatError(f"{where}, block {k}: unknown assistant block {b!r:.80}")
        waiting = bool(calls)
        out.append(msg)
    return out


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    enable_thinking: bool = False,
    continue_assistant_message: bool = False,
    variant: str = "inference",
    bos_token: str = "<s>",
    template: str | None = None,
) -> str:
    """Render a conversation to the exact string the model was trained on.

    ``template`` renders with another template source (a checkpoint's) instead of ``variant``'s.
    """
    return render_normalized(normalize_messages(messages), tools, add_generation_prompt, enable_thinking,
                             continue_assistant_message, variant, bos_token, template)


def render_normalized(
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    enable_thinking: bool = False,
    continue_assistant_message: bool = False,
    variant: str = "inference",
    bos_token: str = "<s>",
    template: str | None = None,
) -> str:
    """Render messages that :func:`normalize_messages` has already checked."""
    compiled = _compiled(variant) if template is None else compile_template(template)
    return compiled.render(
        messages=msgs,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        continue_assistant_message=continue_assistant_message,
        bos_token=bos_token,
    )
