"""Rollout prompts through the core's injection-safe chat encoding: verl's agent loop with an Apertus token builder.

verl 0.9 turns a rollout's chat messages into prompt ids in the agent loop, through a "Continuous
Token" builder (``verl.utils.tokenizer.continuous_token.ContinuousTokenBuilder``): by default
``tokenizer.apply_chat_template(..., tokenize=True)``, which renders the checkpoint's template and
tokenizes the text whole, so a user message containing ``<|system_start|>`` or ``<|image|>`` comes out
as those special ids. The builder is verl's documented extension point for a model family's chat
format (subclass it, override the rendering hook); verl picks its built-in builders by ``model_type``
from a closed table, so the Apertus agent loop installs its own:

* :class:`ApertusContinuousTokenBuilder` renders every prompt (and every appended turn of a multi-turn
  rollout) with :meth:`apertus_plugins.core.chat.ChatTokenizer.encode_conversation`: the ids are the
  core's, byte for byte, whatever the text holds;
* :class:`ApertusSingleTurnAgentLoop` is verl's single-turn agent loop with that builder, registered
  as ``apertus_single_turn`` (the packaged rollout configs select it with
  ``actor_rollout_ref.rollout.agent.default_agent_loop``).

``data.apply_chat_template_kwargs`` passes ``enable_thinking`` (and ``variant``) through, as for
verl's own builder; any other key is an error naming it.

Thinking per prompt (the report's mixed-thinking RL configuration, section 4.5): a prompt record's own
``enable_thinking`` field (a column of the RL or online DPO dataset: true, false, or null/absent) decides
for that prompt; records without it take ``data.apply_chat_template_kwargs.enable_thinking``. verl hands
every column of a record to the agent loop, which is instantiated per sample, so each rollout's prompt is
rendered by the core with its own flag.

Images (the report's RL mix holds image prompts, section 4.5, Table 10): a record read by
:class:`verl_ext.dataset.ApertusRLDataset` carries its images' file bytes or paths
(:data:`MEDIA_FIELD`) and ``{"type": "image"}`` parts in its messages. The loop decodes each
image (the core's media limits), encodes it with the checkpoint's vision tokenizer
(:func:`vision_tokenizer_for`) and lays it out as the released processor does (the ``inference`` image
layout), and the core encoding puts those ids where the parts stand: the prompt ids are
``ChatTokenizer.encode_conversation(messages, media=[MediaItem("image", image_ids(...))])``, the ids a
served request and the offline data path build for the same conversation. The rollout engine gets
token ids only (no multimodal data), so the actor and the reference score the very same ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.utils.tokenizer.continuous_token import ContinuousTokenBuilder

from apertus_plugins.core.chat import ChatTokenizer, MediaItem
from apertus_plugins.core.vocab import default_spec

__all__ = ["ApertusContinuousTokenBuilder", "ApertusSingleTurnAgentLoop", "IMAGE_PARTS", "MEDIA_FIELD", "THINKING_FIELD",
           "chat_tokenizer_for", "image_source", "prompt_image_ids", "sample_thinking", "vision_tokenizer_for"]

#: chat template kwargs the core encoding takes
TEMPLATE_KWARGS = ("enable_thinking", "variant")
#: the prompt record's field that turns thinking on or off for that prompt
THINKING_FIELD = "enable_thinking"
#: the field of a dataset row (and so of the agent loop's keyword arguments) holding the prompt's image sources
#: (:class:`verl_ext.dataset.ApertusRLDataset` fills it)
MEDIA_FIELD = "apertus_images"
#: content-part types that stand for an image (the vocabulary's image modality)
IMAGE_PARTS = frozenset(t for t, lit in default_spec().media_placeholders().items()
                        if lit == default_spec().literal("image"))


def image_source(item: Any, where: str) -> bytes | str:
    """The file bytes or path of one image entry of an RL record: bytes, a path, or a mapping with ``bytes``
    and/or ``path`` (``datasets.Image``'s storage) or ``image`` (a path)."""
    if hasattr(item, "tolist") and not isinstance(item, (bytes, str)):
        item = item.tolist()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    if isinstance(item, dict):
        if item.get("bytes"):
            return bytes(item["bytes"])
        for key in ("path", "image"):
            if isinstance(item.get(key), (str, os.PathLike)) and item[key]:
                return os.fspath(item[key])
        raise ValueError(f"{where}: an image entry needs 'bytes' or 'path' (or 'image': a path), got keys "
                         f"{sorted(item)}")
    raise ValueError(f"{where}: an image entry must be file bytes, a path or a mapping, got {type(item).__name__}")


def sample_thinking(value: Any, default: bool) -> bool:
    """A record's thinking flag: ``true``/``false`` (also 0/1 and numpy booleans), or ``default`` when the
    record has none (``None``, NaN: a missing value in a parquet column). Anything else is an error naming it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return bool(default)
    if hasattr(value, "item") and not isinstance(value, (bool, int)):  # numpy scalars
        value = value.item()
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"prompt record field {THINKING_FIELD!r} must be true, false or null, got {value!r}")


@lru_cache(maxsize=8)
def chat_tokenizer_for(path: str) -> ChatTokenizer:
    """The core's chat tokenizer of a tokenizer directory (one per directory and process)."""
    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the Apertus agent loop needs a tokenizer directory with tokenizer.json; "
                                f"{path!r} has none (set actor_rollout_ref.model.tokenizer_path)")
    return ChatTokenizer(path)


_LOCK = threading.Lock()
#: the ids of the images encoded last in this process, by checkpoint and content: the n rollouts of a prompt
#: (each its own agent loop) encode its image once
_IDS: OrderedDict[tuple[str, str], Any] = OrderedDict()
_IDS_KEPT = 64


def vision_tokenizer_for(path: str) -> Any:
    """The vision tokenizer of a checkpoint directory, on the CPU (one per directory and process)."""
    with _LOCK:
        return _vision_tokenizer(path)


@lru_cache(maxsize=2)
def _vision_tokenizer(path: str) -> Any:
    from apertus_plugins.encoders import load_vision_tokenizer

    return load_vision_tokenizer(path)


def prompt_image_ids(chat: ChatTokenizer, checkpoint: str, sources: Sequence[bytes | str]) -> list[MediaItem]:
    """Each image (file bytes or a path) as its ids: decoded within the core's limits, encoded by the vision
    tokenizer of ``checkpoint``, laid out in the ``inference`` layout (the released processor's)."""
    from apertus_plugins.encoders import image_ids

    out = []
    for src in sources:
        src = _image_input(src)
        key = (checkpoint, hashlib.sha256(src if isinstance(src, bytes) else src.encode()).hexdigest())
        with _LOCK:
            ids = _IDS.get(key)
        if ids is None:
            ids = image_ids(vision_tokenizer_for(checkpoint), src, chat.spec, "inference", chat.text_ids)
            with _LOCK:
                _IDS[key] = ids
                while len(_IDS) > _IDS_KEPT:
                    _IDS.popitem(last=False)
        out.append(MediaItem("image", ids))
    return out


def _image_input(src: bytes | str) -> bytes | str:
    """File bytes stay bytes, anything else is a path (the core opens both with the same checks)."""
    return bytes(src) if isinstance(src, (bytes, bytearray, memoryview)) else str(src)


class ApertusContinuousTokenBuilder(ContinuousTokenBuilder):
    """verl's Continuous Token builder whose rendering is the core's injection-safe chat encoding."""

    def __init__(self, tokenizer: Any, chat_tokenizer: ChatTokenizer, *,
                 chat_template_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs_in = dict(chat_template_kwargs or {})
        unknown = sorted(set(kwargs_in) - set(TEMPLATE_KWARGS))
        if unknown:
            raise ValueError(f"data.apply_chat_template_kwargs has {unknown}; the Apertus chat encoding takes "
                             f"{list(TEMPLATE_KWARGS)}")
        super().__init__(tokenizer, chat_template_kwargs=kwargs_in, **kwargs)
        self.chat_tokenizer = chat_tokenizer
        #: the prompt's images as ids, in order; they replace the image parts of the rendered messages
        self.media: list[MediaItem] = []

    def _render_tokens(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        enc = self.chat_tokenizer.encode_conversation(
            [dict(m) for m in messages], tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=bool(self.chat_template_kwargs.get("enable_thinking", False)),
            variant=str(self.chat_template_kwargs.get("variant", "inference")),
            media=self.media if _has_images(messages) else None)
        return [int(i) for i in enc.ids]


def _has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


@register("apertus_single_turn")
class ApertusSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop; the prompt ids come from :class:`ApertusContinuousTokenBuilder`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.config.actor_rollout_ref.model
        path = getattr(self.tokenizer, "name_or_path", None) or model.get("tokenizer_path") or model.path
        self._chat_tokenizer = chat_tokenizer_for(str(path))
        self._checkpoint = str(model.path)
        self.continuous_token_builder = ApertusContinuousTokenBuilder(
            self.tokenizer, self._chat_tokenizer, chat_template_kwargs=self.apply_chat_template_kwargs)

    def use_sample(self, **sample: Any) -> bool:
        """Render this sample's prompt with its record's thinking flag (:func:`sample_thinking`); returns the flag."""
        kwargs = dict(self.apply_chat_template_kwargs or {})
        flag = sample_thinking(sample.get(THINKING_FIELD), bool(kwargs.get("enable_thinking", False)))
        self.continuous_token_builder = ApertusContinuousTokenBuilder(
            self.tokenizer, self._chat_tokenizer, chat_template_kwargs={**kwargs, "enable_thinking": flag})
        return flag

    async def use_images(self, sources: Any) -> list[MediaItem]:
        """Encode the sample's images (:data:`MEDIA_FIELD`) for the prompt ids; returns them."""
        items = [] if sources is None else list(sources.tolist() if hasattr(sources, "tolist") else sources)
        srcs = [image_source(s, f"image {j}") for j, s in enumerate(items)]
        media = await asyncio.get_running_loop().run_in_executor(
            None, prompt_image_ids, self._chat_tokenizer, self._checkpoint, srcs)
        self.continuous_token_builder.media = media
        return media

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        """Nothing for the rollout engine: the images are ids in the prompt (:meth:`use_images`)."""
        return {}

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        self.use_sample(**kwargs)
        await self.use_images(kwargs.get(MEDIA_FIELD))
        return await super().run(sampling_params, **kwargs)
