"""RL prompt records with images, and the prompt filter that runs before training: verl's dataset for Apertus.

verl 0.9 reads RL prompts with :class:`verl.utils.dataset.rl_dataset.RLHFDataset` (``data.custom_cls`` names
a subclass). Its multimodal path needs a Hugging Face processor and hands decoded images to the rollout
engine; Apertus 1.5 sees an image as discrete tokens, so the image becomes ids in the prompt itself.
:class:`ApertusRLDataset` keeps verl's record format (the layout of verl's own multimodal examples):

* ``prompt``: chat messages; an image goes where a ``<image>`` marker stands in a string content, or as a
  content part ``{"type": "image"}`` (also ``image_url``, ``input_image``);
* ``images``: the images of the record, in order (``data.image_key``): the bytes of an image file, a
  path, or a mapping with ``bytes`` and/or ``path`` (what ``datasets.Image`` stores in parquet) or ``image``.

Before training, every record is checked once (:meth:`ApertusRLDataset.maybe_filter_out_long_prompts`):

* an image that cannot be read or decoded, or is above the media limits
  (:class:`~apertus_plugins.core.media.limits.MediaLimits`), drops its record, the record's id and the reason
  logged, and counted;
* a prompt longer than ``data.max_prompt_length`` (with ``data.filter_overlong_prompts``) is dropped and
  counted. Its length is the core's encoding (:meth:`ChatTokenizer.encode_conversation`) with each image's
  sequence at its real length (the grid from the decoded image's size), the record's own thinking flag
  applied: exactly the length the rollout's prompt will have.

So the run never meets a bad image or an overlong prompt mid-way. The rollout's agent loop
(:mod:`verl_ext.agent_loop`) encodes the images with the checkpoint's vision tokenizer and puts their ids
into the prompt ids: the rollout engine, the actor and the reference all see those ids.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset

from apertus_plugins.core.chat import ChatFormatError, MediaItem
from apertus_plugins.core.media import image as media_image

from .agent_loop import IMAGE_PARTS, MEDIA_FIELD, THINKING_FIELD, chat_tokenizer_for, image_source, sample_thinking

__all__ = ["ApertusRLDataset", "DropReport", "IMAGE_MARKER", "MEDIA_FIELD", "image_source", "prompt_messages"]

logger = logging.getLogger(__name__)

#: the marker of verl's multimodal records in a string content
IMAGE_MARKER = "<image>"


def prompt_messages(messages: Any, n_images: int, where: str) -> list[dict[str, Any]]:
    """The record's messages with every image as the core's ``{"type": "image"}`` part (``<image>`` markers of a
    string content split into parts); the number of image parts must equal the record's images."""
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: the prompt must be a list of chat messages")
    out = []
    count = 0
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if hasattr(content, "tolist") and not isinstance(content, str):
            content = content.tolist()
        if isinstance(content, str) and IMAGE_MARKER in content:
            parts: list[dict[str, Any]] = []
            for seg in re.split(f"({re.escape(IMAGE_MARKER)})", content):
                if seg == IMAGE_MARKER:
                    parts.append({"type": "image"})
                    count += 1
                elif seg:
                    parts.append({"type": "text", "text": seg})
            message["content"] = parts
        elif isinstance(content, list):
            parts = []
            for part in content:
                part = dict(part) if isinstance(part, dict) else part
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                    part = {"type": "image"}
                    count += 1
                elif isinstance(part, dict):  # parquet gives every part every column: keep the set ones
                    part = {k: v for k, v in part.items() if v is not None}
                parts.append(part)
            message["content"] = parts
        out.append({k: v for k, v in message.items() if v is not None})
    if count != n_images:
        raise ValueError(f"{where}: the prompt has {count} image places but the record has {n_images} images")
    return out


@dataclass
class DropReport:
    """What the pre-run check dropped: record ids by reason (``image``: unreadable or over the limits;
    ``format``: a record the chat format cannot render; ``overlong``: longer than the prompt limit)."""

    total: int = 0
    dropped: dict[str, list[tuple[Any, str]]] = field(default_factory=lambda: {"image": [], "format": [],
                                                                                "overlong": []})

    @property
    def kept(self) -> int:
        return self.total - sum(len(v) for v in self.dropped.values())

    def summary(self, max_prompt_length: int) -> str:
        n = {k: len(v) for k, v in self.dropped.items()}
        return (f"apertus RL prompts: {self.kept} of {self.total} kept; dropped {n['overlong']} longer than "
                f"{max_prompt_length} tokens, {n['image']} with an unreadable or oversized image, {n['format']} "
                f"the chat format cannot render")


class ApertusRLDataset(RLHFDataset):
    """verl's RL dataset with images as Apertus media tokens and the pre-run checks of the module docstring."""

    drop_report: DropReport

    def _chat(self) -> Any:
        return chat_tokenizer_for(str(getattr(self.tokenizer, "name_or_path", "")))

    def _record_id(self, row: dict[str, Any], k: int) -> Any:
        info = row.get("extra_info") or {}
        return info.get("index", k) if isinstance(info, dict) else k

    def _row_images(self, row: dict[str, Any], where: str) -> list[bytes | str]:
        images = row.get(self.image_key)
        if images is None:
            return []
        if hasattr(images, "tolist"):
            images = images.tolist()
        return [image_source(item, f"{where}, image {j}") for j, item in enumerate(images)]

    def _check_row(self, row: dict[str, Any], k: int) -> tuple[str, str] | int:
        """The prompt's length in ids, or (reason, message) when the record must be dropped."""
        where = f"record {self._record_id(row, k)!r}"
        chat = self._chat()
        try:
            sources = self._row_images(row, where)
            messages = prompt_messages(row[self.prompt_key], len(sources), where)
        except ValueError as exc:
            return "format", str(exc)
        media = []
        for j, src in enumerate(sources):
            try:
                img = media_image.decode_image(media_image.open_image(src), name=f"{where}, image {j}")
            except (ValueError, OSError) as exc:  # ImageError is a ValueError; a missing file an OSError
                return "image", f"{where}, image {j}: {exc}"
            rows, cols = media_image.image_grid(img.height, img.width)
            media.append(MediaItem("image", media_image.image_placeholder_sequence(
                rows, cols, chat.spec, "inference", chat.text_ids)))
        kwargs = dict(self.apply_chat_template_kwargs or {})
        try:
            thinking = sample_thinking(row.get(THINKING_FIELD), bool(kwargs.get("enable_thinking", False)))
            enc = chat.encode_conversation(messages, add_generation_prompt=True, enable_thinking=thinking,
                                           variant=str(kwargs.get("variant", "inference")), media=media or None)
        except (ChatFormatError, ValueError) as exc:
            return "format", f"{where}: {exc}"
        return len(enc.ids)

    def maybe_filter_out_long_prompts(self, dataframe: Any = None) -> Any:
        """Check every record once (module docstring); drop the bad ones, log each by id and the counts."""
        rows = range(len(dataframe))
        workers = max(1, int(self.num_workers or 1))
        with ThreadPoolExecutor(workers) as pool:  # image decoding releases the GIL
            results = list(pool.map(lambda k: self._check_row(dataframe[k], k), rows))
        report = DropReport(total=len(dataframe))
        keep = []
        for k, res in enumerate(results):
            rid = self._record_id(dataframe[k], k)
            if isinstance(res, tuple):
                report.dropped[res[0]].append((rid, res[1]))
                logger.warning("dropped RL prompt %r: %s", rid, res[1])
            elif self.filter_overlong_prompts and res > self.max_prompt_length:
                report.dropped["overlong"].append((rid, f"{res} tokens"))
                logger.warning("dropped RL prompt %r: %d tokens > data.max_prompt_length %d", rid, res,
                               self.max_prompt_length)
            else:
                keep.append(k)
        self.drop_report = report
        # verl prints its dataset sizes; this line goes beside them in the driver's log
        print(report.summary(self.max_prompt_length), flush=True)
        for reason, items in report.dropped.items():
            if items:
                print(f"apertus RL prompts dropped ({reason}): " + "; ".join(f"{rid!r}: {msg}" for rid, msg in items),
                      flush=True)
        if len(keep) == len(dataframe):
            return dataframe
        return dataframe.select(keep)

    def _build_messages(self, example: dict, key: str) -> list[dict[str, Any]]:
        where = f"record {self._record_id(example, 0)!r}"
        return prompt_messages(example[key], len(self._row_images(example, where)), where)

    def __getitem__(self, item: int) -> dict[str, Any]:
        row = self.dataframe[item]
        sources = self._row_images(row, f"record {self._record_id(row, item)!r}")
        out = super().__getitem__(item)
        out[MEDIA_FIELD] = list(sources)
        return out

    @classmethod
    def image_count(cls, messages: Sequence[dict[str, Any]]) -> int:
        """The number of image parts in ``messages`` (core parts, after :func:`prompt_messages`)."""
        return sum(1 for m in messages if isinstance(m.get("content"), list)
                   for p in m["content"] if isinstance(p, dict) and p.get("type") in IMAGE_PARTS)
