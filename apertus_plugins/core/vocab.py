"""The Apertus 1.5 id layout as data (SPEC.md section 1).

Every other module takes ids from a :class:`VocabSpec`; none writes an id literal of its own.
The default spec is the released layout; :meth:`VocabSpec.scaled` builds a smaller one with the
same structure for tests, and :meth:`VocabSpec.from_tokenizer_dir` reads a tokenizer directory
(``tokenizer_config.json``'s ``omnimodal_config`` and the special tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np

from apertus_plugins.infra.files import read_json

__all__ = [
    "CHAT_TOKENS",
    "OMNI_SLOTS",
    "ALIASES",
    "ModalityRange",
    "VocabSpec",
    "VocabError",
    "default_spec",
    "MediaKind",
    "BUILTIN_MEDIA",
]


class VocabError(ValueError):
    """A vocabulary layout that is inconsistent or does not match a tokenizer or an embedding."""


#: Chat and structure tokens below the text boundary: name -> (literal, default id).
#: ``inner_prefix``/``inner_suffix`` delimit the thinking span; they are deliberately not special.
CHAT_TOKENS: dict[str, tuple[str, int]] = {
    "unk": ("<unk>", 0),
    "bos": ("<s>", 1),
    "eos": ("</s>", 2),
    "pad": ("<pad>", 3),
    "inner_prefix": ("<|inner_prefix|>", 32),
    "inner_suffix": ("<|inner_suffix|>", 33),
    "system_start": ("<|system_start|>", 61),
    "system_end": ("<|system_end|>", 62),
    "developer_start": ("<|developer_start|>", 63),
    "developer_end": ("<|developer_end|>", 64),
    "user_start": ("<|user_start|>", 65),
    "user_end": ("<|user_end|>", 66),
    "assistant_start": ("<|assistant_start|>", 67),
    "assistant_end": ("<|assistant_end|>", 68),
    "tools_prefix": ("<|tools_prefix|>", 71),
    "tools_suffix": ("<|tools_suffix|>", 72),
    "tool_output_start": ("<|tool_output_start|>", 73),
    "tool_output_end": ("<|tool_output_end|>", 74),
}

#: Names of chat tokens that are not special tokens (they survive ``skip_special_tokens``).
NON_SPECIAL_CHAT = frozenset({"inner_prefix", "inner_suffix"})

#: Used slots of the omni block: slot -> (name, literal). Id = omni offset + slot.
OMNI_SLOTS: dict[int, tuple[str, str]] = {
    1: ("img_start", "<|img_start|>"),
    2: ("img_end", "<|img_end|>"),
    3: ("img_token_start", "<|img_token_start|>"),
    4: ("img_end_of_row", "<|img_end_of_row|>"),
    5: ("img_end_of_frame", "<|img_end_of_frame|>"),
    6: ("img_generation_start", "<|img_generation_start|>"),
    7: ("image", "<|image|>"),
    8: ("audio_start", "<|audio_start|>"),
    9: ("audio_end", "<|audio_end|>"),
    10: ("stt_transcribe", "<|stt_transcribe|>"),
    11: ("stt_continue", "<|stt_continue|>"),
    12: ("tts_continue", "<|tts_continue|>"),
    13: ("audio", "<|audio|>"),
    14: ("stt_translate", "<|stt_translate|>"),
    15: ("audio_annotate", "<|audio_annotate|>"),
}


@dataclass(frozen=True)
class MediaKind:
    """A modality as the core sees it, as plain data: how its chat parts are written and where its codes go.

    The built-in image and audio kinds are :data:`BUILTIN_MEDIA`; a plugin modality brings its own
    (``apertus_plugins.plugins`` merges the registered ones into a :class:`VocabSpec`).

    Attributes:
        name: the modality's name (``"image"``); a media item of a conversation has this kind.
        placeholder: marker name of the prompt placeholder (``"image"`` -> ``<|image|>``).
        part_types: chat content-part types that carry this modality (``"image_url"``...).
        task_markers: marker names that condition the model but are never predicted after stage 1.
        code_block: the code block (:class:`ModalityRange`) its content codes are in (default: ``name``);
            the codes' loss role is that block's (a video of image codes trains as image codes).
    """

    name: str
    placeholder: str
    part_types: tuple[str, ...]
    task_markers: tuple[str, ...] = ()
    code_block: str | None = None

    @property
    def codes_in(self) -> str:
        """The code block of its content codes."""
        return self.code_block or self.name


#: The released modalities: images (``<|image|>``) and audio (``<|audio|>``, with its task markers).
BUILTIN_MEDIA: tuple[MediaKind, ...] = (
    MediaKind("image", "image", ("image", "image_url", "input_image")),
    MediaKind("audio", "audio", ("audio", "audio_url", "input_audio"),
              task_markers=("stt_transcribe", "stt_continue", "tts_continue")),
)


#: Surface forms that map to a canonical token: alias literal -> token name.
ALIASES: dict[str, str] = {
    "<think>": "inner_prefix",
    "</think>": "inner_suffix",
    "<image>": "image",
    "<audio>": "audio",
}

#: Older reasoning markup the released normalizer rewrites: literal -> token name, or "" to drop.
LEGACY_REWRITES: dict[str, str] = {
    "<thought>": "inner_prefix",
    "</thought>": "inner_suffix",
    "<answer>": "",
    "</answer>": "",
}

#: Literal format of the content code tokens, per modality.
CODE_TOKEN_FORMATS = {"image": "<|visual token {i}|>", "audio": "<|audio token {i}|>"}


@dataclass(frozen=True)
class ModalityRange:
    """A contiguous block of content codes: code ``i`` is id ``offset + i``."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        """One past the last id of the block."""
        return self.offset + self.size

    def __contains__(self, token_id: object) -> bool:
        return isinstance(token_id, (int, np.integer)) and self.offset <= int(token_id) < self.end


@dataclass(frozen=True)
class VocabSpec:
    """The id layout of Apertus 1.5.

    Args:
        text_size: number of text ids (``0 .. text_size-1``), 131,072 in the release.
        omni_offset: first id of the reserved multimodal ("omni") block.
        omni_size: number of slots of the omni block (200).
        modalities: the content-code blocks, in id order (image, then audio).
        embedding_rows: rows of the input embedding (266,752 in the release: the total plus padding),
            or ``None`` when unknown.
        chat_ids: chat token name -> id (defaults: :data:`CHAT_TOKENS`).
        slots: omni slot -> (name, literal) of the used slots (default: :data:`OMNI_SLOTS`; a plugin
            modality's slots are added by :meth:`extended`).
        media: the modalities whose parts a conversation may carry (default: :data:`BUILTIN_MEDIA`).
        extra_special_ids: further special ids a real tokenizer reserves below the text boundary.
        total_size: the tokenizer's length; defaults to the end of the last block.
    """

    text_size: int = 131_072
    omni_offset: int = 131_072
    omni_size: int = 200
    modalities: tuple[ModalityRange, ...] = (
        ModalityRange("image", 131_272, 131_072),
        ModalityRange("audio", 262_344, 4_096),
    )
    embedding_rows: int | None = 266_752
    chat_ids: Mapping[str, int] = field(default_factory=lambda: {k: v[1] for k, v in CHAT_TOKENS.items()})
    slots: Mapping[int, tuple[str, str]] = field(default_factory=lambda: dict(OMNI_SLOTS))
    extra_special_ids: frozenset[int] = frozenset()
    total_size: int | None = None
    media: tuple[MediaKind, ...] = BUILTIN_MEDIA

    def __post_init__(self) -> None:
        object.__setattr__(self, "media", tuple(self.media))
        object.__setattr__(self, "chat_ids", dict(self.chat_ids))
        object.__setattr__(self, "slots", {int(k): tuple(v) for k, v in self.slots.items()})
        object.__setattr__(self, "modalities", tuple(self.modalities))
        object.__setattr__(self, "extra_special_ids", frozenset(int(i) for i in self.extra_special_ids))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def scaled(
        cls,
        text_size: int = 512,
        omni_size: int = 200,
        image_codes: int = 256,
        audio_codes: int = 64,
        embedding_padding: int = 0,
    ) -> VocabSpec:
        """A smaller spec with the released structure: text, omni block, image codes, audio codes.

        The chat ids keep their released values, so ``text_size`` must exceed the highest of them.
        """
        image = ModalityRange("image", text_size + omni_size, image_codes)
        audio = ModalityRange("audio", image.end, audio_codes)
        return cls(
            text_size=text_size,
            omni_offset=text_size,
            omni_size=omni_size,
            modalities=(image, audio),
            embedding_rows=audio.end + embedding_padding,
        )

    def extended(self, media: Iterable[MediaKind] = (), slots: Mapping[int, tuple[str, str]] | None = None,
                 owner: Mapping[str, str] | None = None) -> VocabSpec:
        """This layout with more modalities and omni slots (a plugin's), each checked against the ones it has.

        ``slots`` (slot -> (name, literal)) must claim free slots under new names; ``media`` adds kinds
        whose names are new. ``owner`` maps a slot's marker name to the modality that brings it, for
        the error messages. Raises :class:`VocabError` naming the clash.
        """
        out = dict(self.slots)
        names = {name: slot for slot, (name, _lit) in out.items()}
        who = dict(owner or {})
        for slot, (name, literal) in (slots or {}).items():
            slot = int(slot)
            by = f"modality {who[name]!r}" if name in who else "a modality"
            if slot in out:
                if out[slot] == (name, literal):
                    continue
                raise VocabError(f"{by} claims omni slot {slot} ({literal!r}), which holds {out[slot][1]!r}")
            if name in names:
                raise VocabError(f"{by} names omni slot {slot} {name!r}, the name of slot {names[name]}")
            out[slot] = (name, literal)
            names[name] = slot
        have = {k.name for k in self.media}
        kinds = self.media + tuple(k for k in media if k.name not in have)
        return replace(self, slots=out, media=kinds)

    @classmethod
    def from_tokenizer_dir(cls, path: str | Path, embedding_rows: int | None = None,
                           media: tuple[MediaKind, ...] = BUILTIN_MEDIA,
                           slots: Mapping[int, tuple[str, str]] | None = None) -> VocabSpec:
        """Read the layout of a tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``).

        Offsets come from ``omnimodal_config`` when present, else from the positions of the marker
        tokens; chat ids are looked up by literal and must all exist; the tokenizer's own special
        tokens below the text boundary become :attr:`extra_special_ids`. The SFT boundary fields of
        the config, when present, must agree with the ids (SPEC.md 4.2).

        ``slots`` names further omni slots to look for (a plugin modality's: slot -> (name, literal));
        those the tokenizer lacks are left out, as are the ``media`` kinds whose placeholder it lacks.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        cfg_file = path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise VocabError(f"{path}: no tokenizer.json (a Hugging Face fast tokenizer directory is required)")
        tok = read_json(tok_file, VocabError)
        cfg: dict[str, Any] = read_json(cfg_file, VocabError) if cfg_file.is_file() else {}
        literal_to_id, special_ids, total = _read_tokenizer_json(tok, tok_file)
        for entry in (cfg.get("added_tokens_decoder") or {}).items():
            tid, info = int(entry[0]), entry[1]
            literal_to_id.setdefault(info.get("content"), tid)
            if info.get("special"):
                special_ids.add(tid)
            total = max(total, tid + 1)

        chat_ids: dict[str, int] = {}
        for name, (literal, _) in CHAT_TOKENS.items():
            if literal not in literal_to_id:
                raise VocabError(f"{path}: the tokenizer lacks the chat token {literal!r} ({name})")
            chat_ids[name] = literal_to_id[literal]

        omni = cfg.get("omnimodal_config")
        if omni:
            omni_offset, omni_size, modalities = _parse_omnimodal_config(omni, cfg_file)
        else:
            first_slot = min(OMNI_SLOTS)
            lit = OMNI_SLOTS[first_slot][1]
            if lit not in literal_to_id:
                raise VocabError(f"{path}: no omnimodal_config and no {lit!r} marker to infer the layout from")
            omni_offset = literal_to_id[lit] - first_slot
            omni_size = 200
            modalities = []
            offset = omni_offset + omni_size
            for name, fmt in CODE_TOKEN_FORMATS.items():
                first = fmt.format(i=0)
                if literal_to_id.get(first) != offset:
                    raise VocabError(f"{path}: expected {first!r} at id {offset}, found {literal_to_id.get(first)}")
                size = 0
                while literal_to_id.get(fmt.format(i=size)) == offset + size:
                    size += 1
                modalities.append(ModalityRange(name, offset, size))
                offset += size

        found = {}
        for slot, (name, literal) in {**(slots or {}), **OMNI_SLOTS}.items():
            if literal not in literal_to_id:
                if slot not in OMNI_SLOTS:
                    continue  # a plugin modality's marker this tokenizer does not have
                raise VocabError(f"{path}: the tokenizer lacks the omni marker {literal!r} (slot {slot})")
            got = literal_to_id[literal]
            if got != omni_offset + slot:
                raise VocabError(
                    f"{path}: marker {literal!r} is id {got}, but omni slot {slot} is id {omni_offset + slot}"
                )
            found[slot] = (name, literal)
        have = {name for name, _lit in found.values()}
        text_size = int(omni.get("text_vocab_size", omni_offset)) if omni else omni_offset
        extra = frozenset(i for i in special_ids if i < text_size) - frozenset(
            v for k, v in chat_ids.items() if k not in NON_SPECIAL_CHAT
        )
        extra = frozenset(i for i in extra if i not in (chat_ids["inner_prefix"], chat_ids["inner_suffix"]))
        spec = cls(
            text_size=text_size,
            omni_offset=omni_offset,
            omni_size=omni_size,
            modalities=tuple(modalities),
            embedding_rows=embedding_rows,
            chat_ids=chat_ids,
            slots=found,
            extra_special_ids=extra,
            total_size=total,
            media=tuple(k for k in media if k.placeholder in have),
        )
        spec.check_sft_boundaries(cfg, literal_to_id, source=cfg_file)
        return spec

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`VocabError` naming the problem if the layout is inconsistent."""
        if self.text_size <= 0:
            raise VocabError(f"text_size must be positive, got {self.text_size}")
        missing = [n for n in CHAT_TOKENS if n not in self.chat_ids]
        if missing:
            raise VocabError(f"chat token ids missing for: {', '.join(missing)}")
        for name, tid in self.chat_ids.items():
            if not 0 <= tid < self.text_size:
                raise VocabError(f"chat token {name} (id {tid}) lies outside the text range 0..{self.text_size - 1}")
        seen: dict[int, str] = {}
        for name, tid in self.chat_ids.items():
            if tid in seen:
                raise VocabError(f"chat tokens {seen[tid]} and {name} share id {tid}")
            seen[tid] = name
        needed = {name for name, _ in OMNI_SLOTS.values()}
        have = {name for name, _ in self.slots.values()}
        if needed - have:
            raise VocabError(f"omni markers missing: {', '.join(sorted(needed - have))}")
        for slot in self.slots:
            if not 0 < slot < self.omni_size:
                raise VocabError(f"omni slot {slot} outside the block of {self.omni_size} slots")
        ranges = [("text", 0, self.text_size), ("omni", self.omni_offset, self.omni_offset + self.omni_size)]
        ranges += [(m.name, m.offset, m.end) for m in self.modalities]
        names = [m.name for m in self.modalities]
        if len(set(names)) != len(names):
            raise VocabError(f"duplicate modality names: {names}")
        for m in self.modalities:
            if m.size <= 0:
                raise VocabError(f"modality {m.name} has no codes (size {m.size})")
        ordered = sorted(ranges, key=lambda r: r[1])
        for (n1, _s1, e1), (n2, s2, _e2) in zip(ordered, ordered[1:], strict=False):
            if s2 < e1:
                raise VocabError(f"id ranges overlap: {n1} ends at {e1 - 1} but {n2} starts at {s2}")
        end = max(r[2] for r in ranges)
        if self.embedding_rows is not None and self.embedding_rows < end:
            raise VocabError(
                f"the layout needs {end} embedding rows (ids 0..{end - 1}) but the embedding has {self.embedding_rows}"
            )
        if self.total_size is not None and self.total_size < end:
            raise VocabError(f"the tokenizer holds {self.total_size} entries, fewer than the layout's {end}")
        marker_names = {name for name, _lit in self.slots.values()}
        parts: dict[str, str] = {}
        for kind in self.media:  # (a kind's code block is checked where codes are placed: the chat tokenizer)
            if kind.placeholder not in marker_names:
                raise VocabError(f"modality {kind.name!r}: its placeholder {kind.placeholder!r} is no omni marker")
            missing = [n for n in kind.task_markers if n not in marker_names]
            if missing:
                raise VocabError(f"modality {kind.name!r}: task markers {missing} are no omni markers")
            for t in kind.part_types:
                if t in parts:
                    raise VocabError(f"content part type {t!r} belongs to both {parts[t]!r} and {kind.name!r}")
                parts[t] = kind.name

    def check_embedding(self, rows: int, what: str = "embedding") -> None:
        """Raise :class:`VocabError` if an embedding of ``rows`` rows cannot hold every id."""
        if rows < self.size:
            raise VocabError(f"the {what} has {rows} rows but the vocabulary needs {self.size} (ids 0..{self.size - 1})")

    def check_sft_boundaries(self, cfg: Mapping[str, Any], literal_to_id: Mapping[str, int] | None = None,
                             source: object = "tokenizer_config.json") -> None:
        """Check ``sft_assistant_begin_sequence``/``sft_eot_token``/``sft_user_begin_sequence`` agree."""
        expect = {
            "sft_assistant_begin_sequence": "assistant_start",
            "sft_eot_token": "assistant_end",
            "sft_user_begin_sequence": "user_start",
        }
        for key, name in expect.items():
            if key not in cfg or cfg[key] is None:
                continue
            value = cfg[key]
            want_literal = CHAT_TOKENS[name][0]
            if isinstance(value, str):
                ok = value == want_literal
            elif isinstance(value, int):
                ok = value == self.chat_ids[name]
            elif isinstance(value, list):
                ok = value in ([self.chat_ids[name]], [want_literal])
            else:
                ok = False
            if not ok:
                raise VocabError(
                    f"{source}: {key} is {value!r} but the chat format's boundary is {want_literal!r} "
                    f"(id {self.chat_ids[name]}); the two must agree"
                )

    # ------------------------------------------------------------------ lookups
    @property
    def size(self) -> int:
        """Number of ids in use: the end of the last block (266,440 in the release)."""
        return max([self.text_size, self.omni_offset + self.omni_size] + [m.end for m in self.modalities])

    @property
    def bos_id(self) -> int:
        return self.chat_ids["bos"]

    @property
    def eos_id(self) -> int:
        return self.chat_ids["eos"]

    @property
    def pad_id(self) -> int:
        return self.chat_ids["pad"]

    def id(self, name: str) -> int:
        """The id of a chat token or an omni marker by name (``"user_start"``, ``"img_start"``...)."""
        if name in self.chat_ids:
            return self.chat_ids[name]
        slot = self._slot_by_name.get(name)
        if slot is None:
            raise KeyError(f"unknown token name {name!r}")
        return self.omni_offset + slot

    def literal(self, name: str) -> str:
        """The surface string of a chat token or omni marker by name."""
        if name in CHAT_TOKENS:
            return CHAT_TOKENS[name][0]
        slot = self._slot_by_name.get(name)
        if slot is None:
            raise KeyError(f"unknown token name {name!r}")
        return self.slots[slot][1]

    @cached_property
    def _slot_by_name(self) -> dict[str, int]:
        return {name: slot for slot, (name, _lit) in self.slots.items()}

    def modality(self, name: str) -> ModalityRange:
        for m in self.modalities:
            if m.name == name:
                return m
        raise KeyError(f"unknown modality {name!r}; this spec has {[m.name for m in self.modalities]}")

    def code_to_id(self, modality: str, codes: Any) -> np.ndarray:
        """Codebook indices -> vocabulary ids (checked against the block size)."""
        m = self.modality(modality)
        arr = np.asarray(codes, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= m.size):
            raise VocabError(f"{modality} codes must lie in 0..{m.size - 1}, got {arr.min()}..{arr.max()}")
        return arr + m.offset

    def code_literal(self, modality: str, index: int) -> str:
        return CODE_TOKEN_FORMATS[modality].format(i=index)

    @cached_property
    def name_to_id(self) -> dict[str, int]:
        """Every named structure token (chat tokens and omni markers) -> id."""
        out = dict(self.chat_ids)
        out.update({name: self.omni_offset + slot for slot, (name, _l) in self.slots.items()})
        return out

    @cached_property
    def id_to_name(self) -> dict[int, str]:
        return {v: k for k, v in self.name_to_id.items()}

    @cached_property
    def literal_to_id(self) -> dict[str, int]:
        """Literal -> id for every structure token, aliases included."""
        out = {self.literal(n): i for n, i in self.name_to_id.items()}
        out.update({alias: self.id(name) for alias, name in ALIASES.items()})
        return out

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The special ids: chat specials, the tokenizer's extra specials and the whole omni block.

        The thinking delimiters are not special.
        """
        ids = {i for n, i in self.chat_ids.items() if n not in NON_SPECIAL_CHAT}
        ids |= set(self.extra_special_ids)
        ids |= set(range(self.omni_offset, self.omni_offset + self.omni_size))
        return frozenset(ids)

    @cached_property
    def structure_ids(self) -> frozenset[int]:
        """Ids that user-supplied text must never produce: the special ids plus the thinking delimiters."""
        return self.special_ids | {self.chat_ids["inner_prefix"], self.chat_ids["inner_suffix"]}

    def special_mask(self, size: int | None = None) -> np.ndarray:
        """Boolean lookup table over ids: True for special ids."""
        table = np.zeros(size or self.size, dtype=bool)
        ids = np.fromiter((i for i in self.special_ids if i < table.size), dtype=np.int64)
        table[ids] = True
        return table

    def modality_of(self, ids: Any) -> np.ndarray:
        """Per id, the index of its modality in ``("text", "omni", *modalities)`` order, as uint8.

        0 = text, 1 = omni block, 2.. = the content blocks in :attr:`modalities` order.
        """
        arr = np.asarray(ids, dtype=np.int64)
        out = np.zeros(arr.shape, dtype=np.uint8)
        out[(arr >= self.omni_offset) & (arr < self.omni_offset + self.omni_size)] = 1
        for k, m in enumerate(self.modalities):
            out[(arr >= m.offset) & (arr < m.end)] = 2 + k
        return out

    @property
    def modality_names(self) -> tuple[str, ...]:
        return ("text", "omni") + tuple(m.name for m in self.modalities)

    # ------------------------------------------------------------------ media kinds
    def media_kind(self, name: str) -> MediaKind:
        """The modality ``name`` of :attr:`media`; ``KeyError`` naming the known ones."""
        for kind in self.media:
            if kind.name == name:
                return kind
        raise KeyError(f"unknown modality {name!r}; this layout has {', '.join(k.name for k in self.media)}")

    def media_for_part(self, part_type: str) -> MediaKind | None:
        """The modality whose chat parts have type ``part_type``, if any."""
        return next((k for k in self.media if part_type in k.part_types), None)

    def media_placeholders(self) -> dict[str, str]:
        """Content-part type -> placeholder literal, for every modality of :attr:`media`."""
        return {t: self.literal(k.placeholder) for k in self.media for t in k.part_types}

    @property
    def task_markers(self) -> tuple[str, ...]:
        """The task-control markers of :attr:`media`: they condition but are never predicted after stage 1."""
        return tuple(dict.fromkeys(n for k in self.media for n in k.task_markers))

    def omnimodal_config(self) -> dict[str, Any]:
        """The ``omnimodal_config`` block this layout writes into ``tokenizer_config.json``."""
        return {
            "text_vocab_size": self.text_size,
            "special_token_offset": self.omni_offset,
            "num_special_tokens": self.omni_size,
            "modalities": [{"name": m.name, "offset": m.offset, "size": m.size} for m in self.modalities],
        }

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description of the layout."""
        return {
            "total": self.size,
            "tokenizer_length": self.total_size,
            "embedding_rows": self.embedding_rows,
            "text": [0, self.text_size - 1],
            "omni": [self.omni_offset, self.omni_offset + self.omni_size - 1],
            "modalities": {m.name: [m.offset, m.end - 1] for m in self.modalities},
            "chat": dict(self.chat_ids),
            "markers": {name: self.omni_offset + slot for slot, (name, _l) in sorted(self.slots.items())},
            "special_ids": len(self.special_ids),
            "extra_special_ids": len(self.extra_special_ids),
        }


def _read_tokenizer_json(tok: Mapping[str, Any], source: Path) -> tuple[dict[str, int], set[int], int]:
    literal_to_id: dict[str, int] = {}
    special: set[int] = set()
    model = tok.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        literal_to_id.update({k: int(v) for k, v in vocab.items()})
        total = max(vocab.values(), default=-1) + 1
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        literal_to_id.update({piece[0]: i for i, piece in enumerate(vocab)})
        total = len(vocab)
    else:
        raise VocabError(f"{source}: unreadable model vocabulary")
    for entry in tok.get("added_tokens") or []:
        tid = int(entry["id"])
        literal_to_id[entry["content"]] = tid
        if entry.get("special"):
            special.add(tid)
        total = max(total, tid + 1)
    return literal_to_id, special, total


def _parse_omnimodal_config(omni: Mapping[str, Any], source: Path) -> tuple[int, int, list[ModalityRange]]:
    def first(keys: Iterable[str], default: Any = None) -> Any:
        for k in keys:
            if k in omni:
                return omni[k]
        return default

    offset = first(("special_token_offset", "special_offset", "special_block_offset", "omni_offset"))
    size = first(("num_special_tokens", "special_size", "special_block_size", "omni_size"), 200)
    if offset is None:
        raise VocabError(f"{source}: omnimodal_config has no special-block offset")
    mods = first(("modalities",), [])
    if isinstance(mods, Mapping):
        mods = [dict(v, name=k) for k, v in mods.items()]
    ranges = []
    for m in mods:
        try:
            ranges.append(ModalityRange(str(m["name"]), int(m["offset"]), int(m["size"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise VocabError(f"{source}: omnimodal_config modality entry {m!r} lacks name/offset/size") from exc
    if not ranges:
        raise VocabError(f"{source}: omnimodal_config lists no modalities")
    return int(offset), int(size), sorted(ranges, key=lambda r: r.offset)


@cache
def default_spec() -> VocabSpec:
    """The released Apertus 1.5 layout, one instance per process (a spec is immutable)."""
    return VocabSpec()
