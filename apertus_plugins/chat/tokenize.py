"""Injection-safe tokenization of a conversation.

The string form is the template's (:func:`~apertus_plugins.chat.template.render`), byte for
byte; the ids differ from ``tokenizer(rendered)`` only where text supplied by a user contains the
literal of a structure token. Structure tokens come from the template itself and are emitted as
ids; every text segment is encoded by the tokenizer's pre-tokenizer and model alone, so no
added or special token and no alias rewrite can fire inside it. If a merge ever produced a
structure id inside text, that piece is re-encoded character by character.

How user text is told apart from the template's own structure: before rendering, every string
of the messages and tools that reaches the output (message content, tool outputs, tool names,
descriptions, enum values and defaults) is wrapped in private-use sentinel characters, which are
removed again while the rendered string is scanned. Assistant text is the one exception to "no
structure": the thinking delimiters in it, in either surface form (``<|inner_prefix|>`` or
``<think>``, ``<|inner_suffix|>`` or ``</think>``), become the delimiter ids, as the released
tokenizer's normalizer does for training data; any other structure literal in assistant text
stays plain text.

Media placeholders (image and audio parts) expand into the media sequences given in ``media``,
in order of appearance; without ``media`` each stays the single placeholder id, which a serving
processor expands later.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..vocab import ALIASES, VocabSpec
from .template import ChatFormatError, normalize_messages, render_normalized

__all__ = ["ROLES", "ChatTokenizer", "Encoded", "MediaItem"]

#: Role codes of :attr:`Encoded.roles`.
ROLES = ("structure", "system", "developer", "user", "assistant", "tool", "image", "audio")
_ROLE = {name: k for k, name in enumerate(ROLES)}
#: The structure token that opens each block, and the role of the block's text.
_OPENS = {"system_start": "system", "developer_start": "developer", "user_start": "user",
          "assistant_start": "assistant", "tool_output_start": "tool", "tool_output_end": "assistant"}

_U_OPEN, _A_OPEN, _CLOSE = "\ue000", "\ue002", "\ue001"
_SENTINELS = re.compile(f"([{_U_OPEN}{_A_OPEN}{_CLOSE}])")


@dataclass(frozen=True)
class MediaItem:
    """The full id sequence of one media item (e.g. from ``media.image.image_sequence``)."""

    kind: str
    ids: Any


@dataclass
class Encoded:
    """Token ids of a conversation with a role code per token (see :data:`ROLES`)."""

    ids: np.ndarray
    roles: np.ndarray

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
    if not isinstance(s, str):
        return s
    if _SENTINELS.search(s):
        raise ChatFormatError("text contains a private-use character U+E000..U+E002 reserved by the tokenizer")
    return f"{mark}{s}{_CLOSE}"


def _wrap_content(content: Any, mark: str) -> Any:
    if isinstance(content, str):
        return _wrap(content, mark) if content else content
    if isinstance(content, dict) and "parts" in content:
        parts = [dict(p, text=_wrap(p["text"], mark)) if p.get("type") == "text" else p for p in content["parts"]]
        return {"parts": parts}
    if isinstance(content, dict) and "blocks" in content:
        blocks = []
        for b in content["blocks"]:
            b = dict(b)
            if "text" in b:
                b["text"] = _wrap(b["text"], mark)
            if "outputs" in b:
                b["outputs"] = [_wrap(o) for o in b["outputs"]]
            if "calls" in b:
                b["calls"] = [_wrap_call(c) for c in b["calls"]]
            blocks.append(b)
        return {"blocks": blocks}
    return content


def _wrap_call(call: dict[str, Any]) -> dict[str, Any]:
    import json

    fn = dict(call.get("function", call))
    args = fn.get("arguments", {})
    # both are rendered verbatim or through tojson, which keeps the sentinels as they are
    fn["name"] = _wrap(fn["name"])
    fn["arguments"] = _wrap(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return {"type": "function", "function": fn}


def _wrap_schema(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("description", "default"):
        if key in out:
            out[key] = _wrap(out[key]) if isinstance(out[key], str) else _wrap(str(out[key]))
    if isinstance(out.get("enum"), list):
        out["enum"] = [_wrap(v) if isinstance(v, str) else v for v in out["enum"]]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {_wrap(k): _wrap_schema(v) for k, v in out["properties"].items()}
        if isinstance(out.get("required"), list):
            out["required"] = [_wrap(r) for r in out["required"]]
    if isinstance(out.get("items"), dict):
        out["items"] = _wrap_schema(out["items"])
    if isinstance(out.get("oneOf"), list):
        out["oneOf"] = [_wrap_schema(v) for v in out["oneOf"]]
    return out


def _wrap_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn = dict(t.get("function", t))
        fn["name"] = _wrap(fn.get("name", ""))
        if "description" in fn:
            fn["description"] = _wrap(fn["description"])
        if isinstance(fn.get("parameters"), dict):
            fn["parameters"] = _wrap_schema(fn["parameters"])
        out.append({"type": "function", "function": fn})
    return out


def _wrap_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        m = dict(m)
        mark = _A_OPEN if m["role"] == "assistant" else _U_OPEN
        m["content"] = _wrap_content(m.get("content"), mark)
        if m.get("reasoning_content"):
            m["reasoning_content"] = _wrap(m["reasoning_content"], _A_OPEN)
        if m.get("tool_calls"):
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
            self.spec = spec or VocabSpec()
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
        spec = self.spec
        ids: list[int] = []
        roles: list[int] = []
        buf: list[str] = []
        state = {"role": "structure", "media": 0}
        placeholders = {spec.id("image"): "image", spec.id("audio"): "audio"}

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
                if item.kind != placeholders[tid]:
                    raise ChatFormatError(f"media item {k} is {item.kind!r} but placeholder {k} is "
                                          f"{placeholders[tid]!r}")
                seq = [int(i) for i in np.asarray(item.ids).ravel()]
                ids.extend(seq)
                roles.extend([_ROLE[item.kind]] * len(seq))
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
        return Encoded(np.asarray(ids, dtype=np.int64), np.asarray(roles, dtype=np.uint8))

    def ids_by_role(self, enc: Encoded) -> list[dict[str, Any]]:
        """``[{"role": ..., "ids": [...]}, ...]`` for ``apertus render --ids``."""
        return [{"role": r, "ids": [int(i) for i in enc.ids[a:b]]} for r, a, b in enc.segments()]
