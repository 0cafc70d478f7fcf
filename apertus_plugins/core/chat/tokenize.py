"""Injection-safe tokenization of a conversation.

The string form is the template's (:func:`~apertus_plugins.core.chat.template.render`), byte for
byte; the ids differ from ``tokenizer(rendered)`` only where text supplied by a user contains the
literal of a structure token. Structure tokens come from the template itself and are emitted as
ids; every text segment is encoded by the tokenizer's pre-tokenizer and model alone, so no
added or special token and no alias rewrite can fire inside it. If a merge ever produced a
structure id inside text, that piece is re-encoded character by character.

How request text is told apart from the template's own structure: before rendering, every
string of the messages and tools that reaches the output (message content, assistant text
included, tool outputs, tool calls, tool names, descriptions, property names, enum values, type
names and defaults, strings inside JSON defaults included) is wrapped in two private-use marks,
which are removed again while the rendered string is scanned (the template ignores them where it
measures or compares a string, so the rendered bytes do not change). The marks are chosen per
conversation among the private-use characters its text does not hold (U+E000 and U+E001 unless
the text uses them), so any text, private-use characters included, stays text.

One rule for every role, assistant history included: text is text. ``<think>``,
``<|inner_prefix|>``, ``<|assistant_end|>`` written in an assistant message stay plain text, as in
a user message; the thinking delimiters come only from the template, which renders a previous
turn's reasoning from ``thoughts`` blocks, and drops ``reasoning_content`` and reasoning parts as
the released template does (:func:`~apertus_plugins.core.chat.template.normalize_messages`).

Media placeholders (the parts of every registered modality, :mod:`apertus_plugins.plugins`)
expand into the media sequences given in ``media``, in order of appearance, their codes taking the
role of their code block; without ``media`` each stays the single placeholder id, which a serving
processor expands later.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..vocab import CODE_TOKEN_FORMATS, LEGACY_REWRITES, VocabSpec, default_spec
from .template import (
    MAX_NESTING,
    ChatFormatError,
    RenderOptions,
    normalize_messages,
    normalize_tools,
    render_normalized,
)

__all__ = ["ROLES", "ChatTokenizer", "Encoded", "MediaItem", "injection_literals"]

#: Role codes of :attr:`Encoded.roles`.
ROLES = ("structure", "system", "developer", "user", "assistant", "tool", "image", "audio")
_ROLE = {name: k for k, name in enumerate(ROLES)}
#: The structure token that opens each block, and the role of the block's text.
_OPENS = {"system_start": "system", "developer_start": "developer", "user_start": "user",
          "assistant_start": "assistant", "tool_output_start": "tool", "tool_output_end": "assistant"}

#: The private-use characters that mark request text in the rendered string, by default; a request
#: whose text holds either gets two other private-use characters (:func:`_marks_for`).
DEFAULT_MARKS = ("\ue000", "\ue001")
#: Private-use ranges the marks are drawn from (the BMP area, then planes 15 and 16).
_PRIVATE_USE = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))


def injection_literals(spec: VocabSpec) -> list[str]:
    """The strings user text must never turn into structure: every chat and omni literal of ``spec``,
    the aliases, the first and last code literal of each modality, ``<SPECIAL_N>`` and the older
    reasoning markup the released normalizer rewrites (``<thought>``, ``<answer>``, channel markers)."""
    out = list(spec.literal_to_id)
    for m in spec.modalities:
        if m.name in CODE_TOKEN_FORMATS:
            out += [spec.code_literal(m.name, 0), spec.code_literal(m.name, m.size - 1)]
    out += list(LEGACY_REWRITES) + ["<|channel|>thought\n", "<channel|>", "<SPECIAL_5>"]
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class MediaItem:
    """The full id sequence of one media item (e.g. from ``media.image.image_sequence``)."""

    kind: str
    ids: Any


@dataclass
class Encoded:
    """Token ids of a conversation with a role code per token (see :data:`ROLES`), and the rendered
    string they encode (media placeholders unexpanded)."""

    ids: np.ndarray
    roles: np.ndarray
    text: str = ""

    def segments(self) -> Iterator[tuple[str, int, int]]:
        """Runs of equal role: ``(role name, start, stop)``."""
        if not len(self.roles):
            return
        change = np.flatnonzero(np.diff(self.roles.astype(np.int16))) + 1
        starts = np.concatenate([[0], change])
        stops = np.concatenate([change, [len(self.roles)]])
        for a, b in zip(starts, stops, strict=True):
            yield ROLES[int(self.roles[a])], int(a), int(b)


def _strings(*objs: Any) -> Iterator[str]:
    """Every string in nested lists and mappings (keys included), without recursion."""
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def _marks_for(*objs: Any) -> tuple[str, str]:
    """Two private-use characters that occur in no string of ``objs``: the default pair unless the
    request's own text holds one of them (text may hold any character; the marks adapt to it)."""
    if not any(DEFAULT_MARKS[0] in s or DEFAULT_MARKS[1] in s for s in _strings(*objs)):
        return DEFAULT_MARKS
    used = set().union(*(set(s) for s in _strings(*objs)))
    free = (chr(c) for lo, hi in _PRIVATE_USE for c in range(lo, hi + 1) if chr(c) not in used)
    marks = tuple(itertools.islice(free, 2))
    if len(marks) < 2:
        raise ChatFormatError("the request's text uses every private-use character; it cannot be marked as text")
    return marks[0], marks[1]


class _Marker:
    """Wraps every string the template prints in the two marks: ``open + text + close``."""

    def __init__(self, marks: tuple[str, str]) -> None:
        self.open, self.close = marks

    def wrap(self, s: Any) -> Any:
        """A string the template prints verbatim, marked as text (the empty string stays empty:
        the template tests some strings for truth)."""
        if not isinstance(s, str) or not s:
            return s
        return f"{self.open}{s}{self.close}"

    def printed(self, v: Any) -> str:
        """A value the template prints with ``str()`` (a number, a container), marked as text."""
        return self.wrap(v if isinstance(v, str) else str(v))

    def json(self, v: Any) -> Any:
        """A value the template writes with ``tojson``: every string inside it marked."""
        if isinstance(v, str):
            return self.wrap(v)
        if isinstance(v, list):
            return [self.json(x) for x in v]
        if isinstance(v, dict):
            return {self.wrap(k): self.json(x) for k, x in v.items()}
        return v

    def content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self.wrap(content)
        if isinstance(content, dict) and isinstance(content.get("parts"), list):
            parts = [self.wrap(p) if isinstance(p, str) else
                     dict(p, text=self.wrap(p.get("text"))) if isinstance(p, dict) and p.get("type") == "text" else p
                     for p in content["parts"]]
            return {**content, "parts": parts}
        if isinstance(content, dict) and isinstance(content.get("blocks"), list):
            blocks = []
            for b in content["blocks"]:
                if not isinstance(b, dict):
                    blocks.append(b)
                    continue
                b = dict(b)
                if "text" in b:
                    b["text"] = self.printed(b["text"])
                if isinstance(b.get("outputs"), list):
                    b["outputs"] = [dict(o, output=self.printed(o["output"])) if isinstance(o, dict) and "output" in o
                                    else o for o in b["outputs"]]
                if isinstance(b.get("calls"), list):
                    b["calls"] = [self.call(c) for c in b["calls"]]
                blocks.append(b)
            return {**content, "blocks": blocks}
        return content

    def fn(self, fn: dict[str, Any]) -> dict[str, Any]:
        """A call's name and arguments marked as text; arguments given as an object are written as
        the JSON the template would write (``tojson``)."""
        fn = dict(fn)
        fn["name"] = self.wrap(fn.get("name"))
        args = fn.get("arguments")
        if isinstance(args, dict):
            fn["arguments"] = self.wrap(json.dumps(args, ensure_ascii=False))
        elif isinstance(args, str):
            fn["arguments"] = self.wrap(args)
        return fn

    def call(self, call: Any) -> Any:
        """The same call, its shape kept (the template reads ``name`` of a bare call)."""
        if not isinstance(call, dict):
            return call
        if isinstance(call.get("function"), dict) and call["function"]:
            return {**call, "function": self.fn(call["function"])}
        return self.fn(call)

    def schema(self, schema: Any) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        if isinstance(out.get("description"), str):
            out["description"] = self.wrap(out["description"])
        if "default" in out:
            out["default"] = self.json(out["default"])
        enum = out.get("enum")
        if isinstance(enum, list):
            out["enum"] = [self.printed(v) for v in enum]
        elif isinstance(enum, dict):
            out["enum"] = {self.printed(k): v for k, v in enum.items()}
        if isinstance(out.get("type"), list):
            out["type"] = [self.printed(t) for t in out["type"]]
        if isinstance(out.get("properties"), dict):
            out["properties"] = {self.wrap(k): self.schema(v) for k, v in out["properties"].items()}
        if isinstance(out.get("required"), list):
            out["required"] = [self.wrap(r) for r in out["required"]]
        if isinstance(out.get("items"), dict):
            out["items"] = self.schema(out["items"])
        if isinstance(out.get("oneOf"), list):
            out["oneOf"] = [self.schema(v) for v in out["oneOf"]]
        return out

    def tool(self, tool: Any) -> Any:
        if not isinstance(tool, dict):
            return tool

        def fn(f: dict[str, Any]) -> dict[str, Any]:
            f = dict(f)
            f["name"] = self.wrap(f.get("name"))
            if isinstance(f.get("description"), str):
                f["description"] = self.wrap(f["description"])
            if isinstance(f.get("parameters"), dict):
                f["parameters"] = self.schema(f["parameters"])
            return f

        if isinstance(tool.get("function"), dict) and tool["function"]:
            return {**tool, "function": fn(tool["function"])}
        return fn(tool)

    def tools(self, tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return [self.tool(t) for t in tools] if tools else None

    def messages(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every string of the messages that the template prints, marked as text; assistant text
        included: text in a conversation is text whoever wrote it (only the template's own
        structure, thinking spans of ``thoughts`` blocks among it, becomes structure ids)."""
        out = []
        for m in msgs:
            m = dict(m)
            role = m["role"]
            if "content" in m:
                c = m["content"]
                if role == "system" and isinstance(c, dict) and "text" in c:
                    m["content"] = dict(c, text=self.wrap(c["text"]))
                elif role == "tool" and not isinstance(c, str):
                    m["content"] = self.printed(c)
                else:
                    m["content"] = self.content(c)
            if role == "assistant" and isinstance(m.get("tool_calls"), list):
                m["tool_calls"] = [self.call(c) for c in m["tool_calls"]]
            out.append(m)
        return out


class ChatTokenizer:
    """Tokenize conversations with a tokenizer directory and its :class:`VocabSpec`.

    Args:
        tokenizer: a tokenizer directory (``tokenizer.json``) or a ``tokenizers.Tokenizer``.
        spec: the layout; read from the directory when omitted.
    """

    def __init__(self, tokenizer: str | Path | Any, spec: VocabSpec | None = None) -> None:
        from tokenizers import Tokenizer

        if isinstance(tokenizer, (str, Path)):
            path = Path(tokenizer)
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            self.spec = spec or VocabSpec.from_tokenizer_dir(path)
        else:
            self._tok = tokenizer
            self.spec = spec or default_spec()
        self._forbidden = self.spec.structure_ids
        lits = {self.spec.literal(n): i for n, i in self.spec.name_to_id.items()}
        self._structure = lits
        self._structure_re = re.compile("|".join(re.escape(s) for s in sorted(lits, key=len, reverse=True)))
        self._id_to_name = self.spec.id_to_name
        names = self.spec.name_to_id
        #: placeholder id -> the modality of the spec it stands for
        self._placeholders = {names[k.placeholder]: k for k in self.spec.media}

    # ------------------------------------------------------------------ plain text
    def text_ids(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text: no added, special or alias token can appear."""
        if not text:
            return []
        out: list[int] = []
        model = self._tok.model
        pre = self._tok.pre_tokenizer
        pieces = [p for p, _ in pre.pre_tokenize_str(text)] if pre is not None else [text]
        for piece in pieces:
            ids = [t.id for t in model.tokenize(piece)]
            if any(i in self._forbidden for i in ids):
                ids = [t.id for ch in piece for t in model.tokenize(ch)]
            out.extend(ids)
        return out

    def char_ids(self, text: str) -> list[int]:
        """One plain-text encoding per character (the image size header "H*W")."""
        return [i for ch in text for i in self.text_ids(ch)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    # ------------------------------------------------------------------ conversations
    def encode_conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            options: RenderOptions | None = None, *, media: Sequence[MediaItem] | None = None,
                            **fields: Any) -> Encoded:
        """Render and tokenize a conversation; see the module docstring for the guarantees.

        ``options`` (or its fields as keywords: ``add_generation_prompt=True``...) says how it is
        rendered (:class:`~apertus_plugins.core.chat.template.RenderOptions`; the BOS literal is this
        vocabulary's); a ``template`` option renders with another template source (a checkpoint's),
        and the guarantees hold as long as that template emits user strings unchanged. The media
        parts it accepts are those of this tokenizer's spec.
        """
        marks = DEFAULT_MARKS
        try:
            opts = replace(RenderOptions.of(options, **fields), bos_token=self.spec.literal("bos"))
            norm = normalize_messages(messages, self.spec)
            checked_tools = normalize_tools(tools)
            marks = _marks_for(norm, checked_tools)
            marker = _Marker(marks)
            text = render_normalized(marker.messages(norm), marker.tools(checked_tools), opts, spec=self.spec,
                                     marks="".join(marks))
        except ChatFormatError as exc:  # its message may quote marked text: the marks never show
            raise ChatFormatError(str(exc).replace(marks[0], "").replace(marks[1], "")) from None
        except (TypeError, AttributeError, KeyError, IndexError) as exc:  # a shape nothing above expected
            msg = f"the conversation cannot be rendered: {type(exc).__name__}: {exc}"
            raise ChatFormatError(msg.replace(marks[0], "").replace(marks[1], "")) from None
        except RecursionError:
            raise ChatFormatError(f"the conversation nests too deeply to render (at most {MAX_NESTING} levels of "
                                  "lists and mappings)") from None
        try:
            return self._scan(text, media, marks)
        except UnicodeError as exc:  # a lone surrogate: not text any tokenizer can encode
            raise ChatFormatError(f"the conversation holds text that is not valid Unicode ({exc})") from None

    def _scan(self, text: str, media: Sequence[MediaItem] | None, marks: tuple[str, str]) -> Encoded:
        ids: list[int] = []
        roles: list[int] = []
        buf: list[str] = []
        state = {"role": "structure", "media": 0}
        placeholders = self._placeholders
        opener, closer = marks

        def flush() -> None:
            if buf:
                seg = self.text_ids("".join(buf))
                ids.extend(seg)
                roles.extend([_ROLE[state["role"]]] * len(seg))
                buf.clear()

        def structure(tid: int) -> None:
            flush()
            if tid in placeholders and media is not None:
                k = state["media"]
                if k >= len(media):
                    raise ChatFormatError(f"the conversation has more media placeholders than the {len(media)} "
                                          "media items given")
                item = media[k]
                mod = placeholders[tid]
                if item.kind != mod.name:
                    raise ChatFormatError(f"media item {k} is {item.kind!r} but placeholder {k} is "
                                          f"{mod.name!r}")
                if mod.codes_in not in _ROLE:
                    raise ChatFormatError(f"media item {k} ({mod.name}): its codes are in the block "
                                          f"{mod.codes_in!r}, which has no role (roles: {', '.join(ROLES)})")
                seq = [int(i) for i in np.asarray(item.ids).ravel()]
                ids.extend(seq)
                roles.extend([_ROLE[mod.codes_in]] * len(seq))
                state["media"] = k + 1
                return
            ids.append(tid)
            roles.append(_ROLE["structure"])
            name = self._id_to_name.get(tid)
            if name in _OPENS:
                state["role"] = _OPENS[name]

        marked = False
        for chunk in re.split(f"([{re.escape(opener)}{re.escape(closer)}])", text):
            if chunk == opener:
                marked = True
            elif chunk == closer:
                marked = False
            elif not chunk:
                continue
            elif marked:  # request text: plain text, whatever it holds
                buf.append(chunk)
            else:  # the template's own text: its structure literals are structure
                pos = 0
                for m in self._structure_re.finditer(chunk):
                    buf.append(chunk[pos:m.start()])
                    structure(self._structure[m.group()])
                    pos = m.end()
                buf.append(chunk[pos:])
        flush()
        if media is not None and state["media"] != len(media):
            raise ChatFormatError(f"{len(media)} media items given but the conversation has "
                                  f"{state['media']} media placeholders")
        return Encoded(np.asarray(ids, dtype=np.int64), np.asarray(roles, dtype=np.uint8),
                       text.replace(opener, "").replace(closer, ""))

    def ids_by_role(self, enc: Encoded) -> list[dict[str, Any]]:
        """``[{"role": ..., "ids": [...]}, ...]`` for ``apertus render --ids``."""
        return [{"role": r, "ids": [int(i) for i in enc.ids[a:b]]} for r, a, b in enc.segments()]
