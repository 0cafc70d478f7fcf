"""Conversations for SFT: whether they reason, and the same conversation with the reasoning removed.

A conversation reasons when an assistant message carries ``reasoning_content`` (or ``reasoning``),
a ``thoughts`` block, or a thinking span in its text in either surface form
(``<|inner_prefix|>…<|inner_suffix|>`` or ``<think>…</think>``). Unless the record says
``enable_thinking``, a reasoning conversation is rendered with deliberation enabled. The chat
template renders thinking from ``thoughts`` blocks only, so a record whose assistant messages carry
``reasoning_content`` is rendered in the blocks form (``chat.template.reasoning_as_blocks``).

The copy without reasoning (``--without-reasoning``, SPEC.md 4.2) drops all of that: the
``reasoning_content``, the ``thoughts`` blocks and every thinking span of assistant text (an
unclosed span runs to the end of the message; a media part inside a span goes with it), and it
is rendered with deliberation disabled. Everything else is identical, media codes included.
"""

from __future__ import annotations

from typing import Any

from apertus_plugins.core.chat.parse import THINK_CLOSE, THINK_OPEN, find_markers

__all__ = ["has_reasoning", "strip_reasoning"]



def _next(text: str, delimiters: tuple[str, ...], start: int = 0) -> tuple[int, int] | None:
    """Start and end of the first of ``delimiters`` in ``text`` from ``start`` (the core's scanner)."""
    hit = next(find_markers(text, delimiters, start), None)
    return None if hit is None else (hit[0], hit[0] + len(hit[1]))


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, dict) and "parts" in content:
        return [p["text"] for p in content["parts"] if isinstance(p, dict) and p.get("type") == "text"]
    if isinstance(content, dict) and "blocks" in content:
        return [b.get("text", "") for b in content["blocks"] if b.get("type") == "response"]
    return []


def has_reasoning(messages: list[dict[str, Any]]) -> bool:
    """Whether any assistant message of normalized ``messages`` carries reasoning."""
    for m in messages:
        if m.get("role") != "assistant":
            continue
        if m.get("reasoning_content"):
            return True
        content = m.get("content")
        if isinstance(content, dict) and any(b.get("type") == "thoughts" for b in content.get("blocks", [])):
            return True
        if any(_next(t, THINK_OPEN) for t in _texts(content)):
            return True
    return False


class _Stripper:
    """Removes thinking spans from a sequence of texts, a span possibly running across them."""

    def __init__(self) -> None:
        self.inside = False

    def text(self, s: str) -> str:
        out = []
        pos = 0
        while pos <= len(s):
            if self.inside:
                m = _next(s, THINK_CLOSE, pos)
                if m is None:
                    return "".join(out)
                pos, self.inside = m[1], False
            else:
                m = _next(s, THINK_OPEN, pos)
                if m is None:
                    out.append(s[pos:])
                    return "".join(out)
                out.append(s[pos : m[0]])
                pos, self.inside = m[1], True
        return "".join(out)


def strip_reasoning(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bool]]:
    """Normalized ``messages`` without their reasoning, and for each media part whether it is kept.

    Returns ``(messages, kept)``, ``kept`` aligned with the media parts of the input in rendering
    order (:func:`apertus_plugins.data.offline.sources.media_parts`).
    """
    from .sources import media_parts

    media_at = {(mi, pi) for mi, pi, _k, _p in media_parts(messages)}
    kept: dict[tuple[int, int], bool] = {}
    out = []
    for mi, m in enumerate(messages):
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")}
        content = m.get("content")
        strip = _Stripper()
        if isinstance(content, str):
            m["content"] = strip.text(content)
        elif isinstance(content, dict) and "parts" in content:
            parts = []
            for pi, p in enumerate(content["parts"]):
                if (mi, pi) in media_at:
                    kept[(mi, pi)] = not strip.inside
                    if not strip.inside:
                        parts.append(p)
                elif isinstance(p, dict) and p.get("type") == "text":
                    parts.append(dict(p, text=strip.text(p["text"])))
                else:
                    parts.append(p)
            m["content"] = {"parts": parts}
        elif isinstance(content, dict) and "blocks" in content:
            blocks = []
            for b in content["blocks"]:
                if b.get("type") == "thoughts":
                    continue
                if b.get("type") == "response":
                    b = dict(b, text=strip.text(b.get("text", "")))
                blocks.append(b)
            m["content"] = {"blocks": blocks}
        out.append(m)
    return out, [kept.get(k, True) for k in sorted(media_at)]
