"""The pack step: each item's codes laid out as its documents (the ids of every output stream).

Pretraining: one document per item (``[BOS] body [EOS]``; a caption before or after the media, a
transcript around a clip). SFT: the conversation through the chat template with its media
sequences, the copy without reasoning and the loss masks when asked. Interleaved: a recording's
clips and transcripts as one or more sequences, each routed to the stream its length picks. An item whose encoding failed
is skipped at stage ``encode``, one whose document cannot be built at stage ``document``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..interleaved import route_by_length
from ..sources import BadInput, Item, Reasons, Skip, unexpected
from .context import RunContext
from .records import Decoded, Encoded, Packed

__all__ = ["Pack"]


class Pack:
    """Documents of a decoded and encoded batch, item by item (one bad item costs only itself)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def __call__(self, dec: Decoded, enc: Encoded) -> Packed:
        skips = dict(dec.skips)
        codes = self._codes(dec, enc, skips)
        docs: list[tuple[int, dict[str, np.ndarray]]] = []
        for it in dec.items:
            if it.index in skips:
                continue
            try:
                if it.kind == "conversation":
                    media_ids = [self.sequence(m.kind, codes[(it.index, k)]) for k, m in enumerate(it.media)]
                    docs.append((it.index, self.sft_documents(it, media_ids, dec.conversations[it.index])))
                elif it.kind == "recording":
                    clip_codes = [codes[(it.index, k)] for k in range(len(it.media))]
                    seqs = self.recording_documents(it, clip_codes, dec.conversations[it.index])
                    docs.extend((it.index, {suffix: d}) for suffix, d in route_by_length(seqs, self.ctx.cfg.split_tokens))
                else:
                    docs.append((it.index, {"": self.pretrain_document(it, codes[(it.index, 0)])}))
            except BadInput as exc:
                skips[it.index] = Skip(it.name, exc.reason, exc.detail, "document")
            except Exception as exc:  # noqa: BLE001 (one item's failure costs only that item)
                skips[it.index] = unexpected(it.name, "document", exc)
        return Packed(docs, skips)

    @staticmethod
    def _codes(dec: Decoded, enc: Encoded, skips: dict[int, Skip]) -> dict[tuple[int, int], np.ndarray]:
        """The codes by ``(item, media position)``; an item with an array the encoder failed on is skipped."""
        by_index = {it.index: it for it in dec.items}
        codes: dict[tuple[int, int], np.ndarray] = {}
        for kind, (keys, _arr) in dec.arrays.items():
            failed = enc.failed.get(kind, {})
            for pos, (key, c) in enumerate(zip(keys, enc.codes.get(kind, []), strict=True)):
                i, k = key
                if pos in failed:
                    it = by_index[i]
                    skips.setdefault(i, Skip(it.name, Reasons.ENCODER, f"{it.media[k].name}: the {kind} encoder failed "
                                             f"on it alone ({failed[pos]}); the rest of its batch is written", "encode"))
                else:
                    codes[(i, k)] = c
        return codes

    def sequence(self, kind: str, codes: np.ndarray) -> np.ndarray:
        """The id sequence of one media item, through the registered modality's builder."""
        ctx = self.ctx
        mod = ctx.registry.modalities[kind]
        kw = {"layout": ctx.cfg.image_layout} if mod.codes_in == "image" else {}  # image-coded: the run's layout
        return np.asarray(mod.build_sequence(codes, ctx.spec, text_ids=ctx.chat.char_ids, **kw), dtype=np.int64)

    def pretrain_document(self, item: Item, codes: np.ndarray) -> np.ndarray:
        """The one document of a pretraining item: its media with its caption or transcript."""
        from apertus_plugins.core.media.audio import transcription_sequence

        cfg, chat, spec = self.ctx.cfg, self.ctx.chat, self.ctx.spec
        ref = item.media[0]
        text = item.text or None
        if ref.kind == "audio" and codes.size == 0:
            raise BadInput(Reasons.PADDED, f"{ref.name}: padded in its batch, it loses its last five codes and none "
                           "are left (--audio-batching report)")
        if ref.kind == "audio":
            task = cfg.audio_task
            if task == "auto":
                task = "transcribe" if text else "audio"
            if task == "audio":
                body = self.sequence("audio", codes)
            elif not text:
                raise BadInput(Reasons.NO_TRANSCRIPT, f"{item.name}: --audio-task {task} needs a transcript "
                                     "(a .txt beside the clip or a txt component), none found")
            else:
                body = transcription_sequence(codes, chat.text_ids(text), spec, task)
        else:
            seq = self.sequence(ref.kind, codes)
            caption = np.asarray(chat.text_ids(text) if text and cfg.captions != "ignore" else [], np.int64)
            body = np.concatenate([caption, seq] if cfg.captions == "before" else [seq, caption])
        head = [spec.bos_id] if cfg.bos else []
        tail = [spec.eos_id] if cfg.eos else []
        return np.concatenate([np.asarray(head, np.int64), body, np.asarray(tail, np.int64)])

    def recording_documents(self, item: Item, codes: list[np.ndarray], transcripts: list[str]) -> list[np.ndarray]:
        """The interleaved documents of one recording (:mod:`..interleaved`)."""
        from ..interleaved import recording_documents

        for ref, c in zip(item.media, codes, strict=True):
            if c.size == 0:
                raise BadInput(Reasons.PADDED, f"{ref.name}: padded in its batch, it loses its last five codes and "
                               "none are left (--audio-batching report)")
        texts = [self.ctx.chat.text_ids(t) for t in transcripts]
        return recording_documents(codes, texts, self.ctx.spec, bos=self.ctx.cfg.bos, eos=self.ctx.cfg.eos)

    def sft_documents(self, item: Item, media_ids: list[np.ndarray], record: Any) -> dict[str, np.ndarray]:
        """Ids (and masks) of one conversation for every stream."""
        from apertus_plugins.core.chat import ChatFormatError, MediaItem, normalize_messages
        from apertus_plugins.core.chat.template import reasoning_as_blocks
        from apertus_plugins.core.targets import sft_mask

        from ..sft import has_reasoning, strip_reasoning

        cfg, chat, spec = self.ctx.cfg, self.ctx.chat, self.ctx.spec
        messages, tools, thinking, _base = record
        items = [MediaItem(ref.kind, ids) for ref, ids in zip(item.media, media_ids, strict=True)]
        out: dict[str, np.ndarray] = {}
        try:
            messages = reasoning_as_blocks(messages)  # the template renders thinking from blocks only
            norm = normalize_messages(messages, spec)
            enable = has_reasoning(norm) if thinking is None else thinking
            enc = chat.encode_conversation(messages, tools=tools, enable_thinking=enable, variant="training",
                                           media=items)
            out[""] = enc.ids
            if cfg.without_reasoning:
                stripped, kept = strip_reasoning(norm)
                enc2 = chat.encode_conversation(stripped, tools=tools, enable_thinking=False, variant="training",
                                                media=[m for m, k in zip(items, kept, strict=True) if k])
                out[".noreason"] = enc2.ids
        except ChatFormatError as exc:
            raise BadInput(Reasons.CONVERSATION, f"{item.name}: {exc}") from exc
        if cfg.mask_stream:
            for key in [k for k in out if not k.endswith(".mask")]:
                ids = out[key]
                mask = np.zeros(ids.size, dtype=np.uint8)
                mask[1:] = sft_mask(ids, spec)
                out[f"{key}.mask"] = mask
        return out
