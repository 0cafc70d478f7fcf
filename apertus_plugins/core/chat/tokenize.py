"""Injection-safe tokenization of a conversation.

The string form is the template's (:func:`~apertus_plugins.core.chat.template.render`), byte for
byte; the ids differ from ``tokenizer(rendered)`` only where text supplied by a user contains the
literal of a structure token. Structure tokens come from the template itself and are emitted as
ids; every text segment is encoded by the tokenizer's pre-tokenizer and model alone, so no
added or special token and no alias rewrite can fire inside it. If a merge ever produced a
structure id inside text, that piece is re-encoded character by character.

How user text is told apart from the template's own structure: before rendering, every string
of the messages and tools that reaches the output (message content, tool outputs, tool calls,
tool names, descriptions, property names, enum values, type names and defaults, strings inside
JSON defaults included) is wrapped in private-use sentinel characters, which are removed again
while the rendered string is scanned (the template ignores them where it measures or compares a
string, so the rendered bytes do not change). Assistant text is the one exception to "no
structure": the thinking delimiters in it, in either surface form (``<|inner_prefix|>`` or
``<think>``, ``<|inner_suffix|>`` or ``</think>``), become the delimiter ids, as the released
tokenizer's normalizer does for training data; any other structure literal in assistant text
stays plain text.

Media placeholders (the parts of every registered modality, :mod:`apertus_plugins.plugins`)
expand into the media sequences given in ``media``, in order of appearance, their codes taking the
role of their code block; without ``media`` each stays the single placeholder id, which a serving
processor expands later.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from apertus_plugins.core.vocab import ALIASES, CODE_TOKEN_FORMATS, LEGACY_REWRITES, VocabSpec, default_spec

from .template import ChatFormatError, normalize_messages, render_normalized

__all__ = ["ROLES", "ChatTokenizer", "Encoded", "MediaItem", "injection_literals"]

#: Role codes of :attr:`Encoded.roles`.
ROLES = ("structure", "system", "developer", "user", "assistant", "tool", "image", "audio")
_ROLE = {name: k for k, name in enumerate(ROLES)}
#: The structure token that opens each block, and the role of the block's text.
_OPENS = {"system_start": "system", "developer_start": "developer", "user_start": "user",
          "assistant_start": "assistant", "tool_output_start": "tool", "tool_output_end": "assistant"}

_U_OPEN, _A_OPEN, _CLOSE = "\ue000", "\ue002", "\ue001"
_SENTINELS = re.compile(f"([{_U_OPEN}{_A_OPEN}{_CLOSE}])")


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


def _wrap(s: Any, mark: str = _U_OPEN) -> Any:
    """A string the template prints verbatim, marked as text (the empty string stays empty:
    the template tests some strings for truth)."""
    if not isinstance(s, str) or not s:
        return s
    if _SENTINELS.search(s):
        raise ChatFormatError("text contains a private-use character U+E000..U+E002 reserved by the tokenizer")
    return f"{mark}{s}{_CLOSE}"


def _printed(v: Any, mark: str = _U_OPEN) -> str:
    """A value the template prints with ``str()`` (a number, a container), marked as text."""
    return _wrap(v if isinstance(v, str) else str(v), mark)


def _wrap_json(v: Any) -> Any:
    """A value the template writes with ``tojson``: every string inside it marked."""
    if isinstance(v, str):
        return _wrap(v)
    if isinstance(v, list):
        return [_wrap_json(x) for x in v]
    if isinstance(v, dict):
        return {_wrap(k): _wrap_json(x) for k, x in v.items()}
    return v


def _wrap_content(content: Any, mark: str) -> Any:
    if isinstance(content, str):
        return _wrap(content, mark)
    if isinstance(content, dict) and "parts" in content:
        parts = [_wrap(p, mark) if isinstance(p, str) else
                 dict(p, text=_wrap(p["text"], mark)) if p.get("type") == "text" else p for p in content["parts"]]
        return {**content, "parts": parts}
    if isinstance(content, dict) and "blocks" in content:
        blocks = []
        for b in content["blocks"]:
            b = dict(b)
            if "text" in b:
                b["text"] = _printed(b["text"], mark)
            if isinstance(b.get("outputs"), list):
                b["outputs"] = [dict(o, output=_printed(o["output"])) if isinstance(o, dict) and "output" in o else o
                                for o in b["outputs"]]
            if isinstance(b.get("calls"), list):
                b["calls"] = [_wrap_call(c) for c in b["calls"]]
            blocks.append(b)
        return {**content, "blocks": blocks}
    return content


def _wrap_fn(fn: dict[str, Any]) -> dict[str, Any]:
    """A call's (or a tool's) name and arguments marked as text; arguments given as an object are
    written as the JSON the template would write (``tojson``)."""
    fn = dict(fn)
    fn["name"] = _wrap(fn.get("name"))
    args = fn.get("arguments")
    if isinstance(args, dict):
        fn["arguments"] = _wrap(json.dumps(args, ensure_ascii=False))
    elif isinstance(args, str):
        fn["arguments"] = _wrap(args)
    return fn


def _wrap_call(call: Any) -> Any:
    """The same call, its shape kept (the template reads ``name`` of a bare call)."""
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict) and call["function"]:
        return {**call, "function": _wrap_fn(call["function"])}
    return _wrap_fn(call)


def _wrap_schema(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("description"), str):
        out["description"] = _wrap(out["description"])
    if "default" in out:
        out["default"] = _wrap_json(out["default"])
    enum = out.get("enum")
    if isinstance(enum, list):
        out["enum"] = [_printed(v) for v in enum]
    elif isinstance(enum, dict):
        out["enum"] = {_printed(k): v for k, v in enum.items()}
    if isinstance(out.get("type"), list):
        out["type"] = [_printed(t) for t in out["type"]]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {_wrap(k): _wrap_schema(v) for k, v in out["properties"].items()}
    if isinstance(out.get("required"), list):
        out["required"] = [_wrap(r) for r in out["required"]]
    if isinstance(out.get("items"), dict):
        out["items"] = _wrap_schema(out["items"])
    if isinstance(out.get("oneOf"), list):
        out["oneOf"] = [_wrap_schema(v) for v in out["oneOf"]]
    return out


def _wrap_tool(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return tool

    def fn(f: dict[str, Any]) -> dict[str, Any]:
        f = dict(f)
        f["name"] = _wrap(f.get("name"))
        if isinstance(f.get("description"), str):
            f["description"] = _wrap(f["description"])
        if isinstance(f.get("parameters"), dict):
            f["parameters"] = _wrap_schema(f["parameters"])
        return f

    if isinstance(tool.get("function"), dict) and tool["function"]:
        return {**tool, "function": fn(tool["function"])}
    return fn(tool)


def _wrap_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [_wrap_tool(t) for t in tools] if tools else None


def _wrap_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every string of the messages that the template prints, marked: assistant text with
    ``_A_OPEN`` (thinking delimiters in it become ids), all other text with ``_U_OPEN``."""
    out = []
    for m in msgs:
        m = dict(m)
        role = m["role"]
        if "content" in m:
            c = m["content"]
            if role == "system" and isinstance(c, dict) and "text" in c:
                m["content"] = dict(c, text=_wrap(c["text"]))
            elif role == "tool" and not isinstance(c, str):
                m["content"] = _printed(c)
            else:
                m["content"] = _wrap_content(c, _A_OPEN if role == "assistant" else _U_OPEN)
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_wrap_call(c) for c in m["tool_calls"]]
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
        delims = {self.spec.literal("inner_prefix"): self.spec.id("inner_prefix"),
                  self.spec.literal("inner_suffix"): self.spec.id("inner_suffix")}
        delims.update({a: self.spec.id(n) for a, n in ALIASES.items() if n in ("inner_prefix", "inner_suffix")})
        self._delims = delims
        self._delim_re = re.compile("|".join(re.escape(s) for s in sorted(delims, key=len, reverse=True)))
        self._id_to_name = self.spec.id_to_name
        from apertus_plugins.plugins import registry

        names = self.spec.name_to_id
        #: placeholder id -> the registered modality it stands for (those this vocabulary has)
        self._placeholders = {names[m.placeholder]: m for m in registry().modalities.values() if m.placeholder in names}

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
    def encode_conversation(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        enable_thinking: bool = False,
        continue_assistant_message: bool = False,
        variant: str = "inference",
        media: Sequence[MediaItem] | None = None,
        template: str | None = None,
    ) -> Encoded:
        """Render and tokenize a conversation; see the module docstring for the guarantees.

        ``template`` renders with another template source (a checkpoint's) instead of ``variant``'s;
        the guarantees hold as long as that template emits user strings unchanged.
        """
        msgs = _wrap_messages(normalize_messages(messages))
        text = render_normalized(msgs, tools=_wrap_tools(tools), add_generation_prompt=add_generation_prompt,
                                 enable_thinking=enable_thinking,
                                 continue_assistant_message=continue_assistant_message, variant=variant,
                                 bos_token=self.spec.literal("bos"), template=template)
        return self._scan(text, media)

    def _scan(self, text: str, media: Sequence[MediaItem] | None) -> Encoded:
        ids: list[int] = []
        roles: list[int] = []
        buf: list[str] = []
        state = {"role": "structure", "media": 0}
        placeholders = self._placeholders

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

        mode = None
        for chunk in _SENTINELS.split(text):
            if chunk in (_U_OPEN, _A_OPEN):
                mode = chunk
                continue
            if chunk == _CLOSE:
                mode = None
                continue
            if not chunk:
                continue
            if mode == _U_OPEN:
                buf.append(chunk)
            elif mode == _A_OPEN:
                pos = 0
                for m in self._delim_re.finditer(chunk):
                    buf.append(chunk[pos:m.start()])
                    structure(self._delims[m.group()])
                    pos = m.end()
                buf.append(chunk[pos:])
            else:
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
        return Encoded(np.asarray(ids, dtype=np.int64), np.asarray(roles, dtype=np.uint8), _SENTINELS.sub("", text))

    def ids_by_role(self, enc: Encoded) -> list[dict[str, Any]]:
        """``[{"role": ..., "ids": [...]}, ...]`` for ``apertus render --ids``."""
        return [{"role": r, "ids": [int(i) for i in enc.ids[a:b]]} for r, a, b in enc.segments()]
