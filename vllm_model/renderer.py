"""The chat path of Apertus 1.5 in vLLM: a conversation becomes the core's injection-safe ids.

vLLM's stock chat path renders a request with the checkpoint's chat template and tokenizes the
whole string, so user text holding ``<|system_start|>``, ``<|assistant_end|>`` or ``<|image|>``
turns into those special ids (a forged system block, a forged turn, a media slot). This renderer
keeps vLLM's own request parsing (OpenAI content parts, media loading, tool-call arguments,
``chat_template_kwargs``) and replaces the template-and-tokenize step with
:meth:`apertus_plugins.core.chat.ChatTokenizer.encode_conversation`: the template's structure tokens
become ids, every string of the request is encoded as plain text. The ids are exactly the core's
for the same request; the prompt text vLLM reports is the rendered template string.

It serves every path that renders a conversation in vLLM (``/v1/chat/completions``, streamed or
not, ``/tokenize`` with ``messages``, the Responses and Anthropic APIs), registered as vLLM's
tokenizer and renderer mode ``apertus`` (``vllm.renderers.registry.RENDERER_REGISTRY``, vLLM's
extension point for chat renderers). The model's config hook
(:class:`vllm_model.generation.Apertus1p5GenerationDefaults`) selects the mode for an Apertus 1.5
checkpoint when ``--tokenizer-mode`` is ``auto``; ``--tokenizer-mode hf`` gives vLLM's stock path
back (not injection-safe: ``apertus doctor --serve`` fails ``serve.injection`` there). Completion
requests with a raw prompt (``/v1/completions``) are tokenized as vLLM always does: the caller owns
that whole prompt.

Hostile requests cost only themselves: whatever goes wrong while a conversation becomes ids (the
core's refusal, a recursion, a media item that cannot be fetched or decoded, media that take
longer than ``media_load_seconds`` to arrive) is a ``ValueError`` with the plugin's message, which
vLLM answers with a 400. The template flags must be booleans (``"enable_thinking": "false"`` is a
400, not thinking on). Assistant reasoning parts (``thinking``) are lifted out of the content
before vLLM's parser would flatten them into answer text (:func:`apertus_plugins.core.chat.template.
lift_reasoning_parts`). Images are preprocessed here, in the plugin's own thread pool, in parallel
across requests (:func:`vllm_model.processing.prepare_image`): vLLM runs the multimodal processor
of an API server on one thread shared by every request, so a large image processed there would
hold up every other media request; here it delays only its own. With the media-code cache on, an
image whose codes are stored reaches the engine as token ids (:mod:`vllm_model.known_media`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache, cached_property
from typing import Any

from vllm.exceptions import VLLMClientError
from vllm.renderers.chat_utils import parse_chat_messages, parse_chat_messages_async
from vllm.renderers.hf import HfRenderer, resolve_chat_template
from vllm.utils.async_utils import make_async

from apertus_plugins.core.chat import ChatFormatError, ChatTokenizer
from apertus_plugins.core.chat.template import lift_reasoning_parts
from apertus_plugins.core.vocab import VocabSpec

from .logs import get_logger

logger = get_logger(__name__)  # under vLLM's `vllm` logger: shown by `vllm serve`

__all__ = ["Apertus1p5Renderer", "MALLOC_ENV", "MEDIA_WORKERS_ENV", "return_freed_memory"]

#: Threads that preprocess images for the renderer of one API server (default: the CPU count, at most 4).
MEDIA_WORKERS_ENV = "APERTUS_MEDIA_WORKERS"
#: Set to 0 to keep glibc's default malloc thresholds in the API server (see :func:`return_freed_memory`).
MALLOC_ENV = "APERTUS_MMAP_THRESHOLD"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@cache
def return_freed_memory() -> int:
    """Make glibc hand large freed blocks back to the system in this (API server) process.

    A decoded image is hundreds of MB in blocks of a few MB; glibc's adaptive threshold soon serves
    such blocks from its heaps and keeps them after they are freed, so the server's memory would
    stay at its peak after a burst of large images. A fixed mmap threshold (4 MiB, or
    ``$APERTUS_MMAP_THRESHOLD`` bytes; 0 keeps glibc's default) maps every larger block on its own
    and unmaps it when freed. Returns the threshold set (0: none, or not glibc).
    """
    import ctypes
    import ctypes.util

    threshold = int(os.environ.get(MALLOC_ENV, 4 << 20))
    if threshold <= 0:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return threshold if libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 else 0
    except (OSError, AttributeError):  # not glibc
        return 0


@cache
def _media_pool() -> ThreadPoolExecutor:
    workers = int(os.environ.get(MEDIA_WORKERS_ENV) or min(4, os.cpu_count() or 1))
    return ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="apertus-media")


def _discard(task: asyncio.Future) -> None:
    """Drop what a task that nobody awaits any more ended with (its exception included)."""
    if not task.cancelled():
        task.exception()


def _request_error(what: str, exc: BaseException) -> ValueError:
    return ValueError(f"Apertus 1.5 {what}: {type(exc).__name__}: {exc}")


class Apertus1p5Renderer(HfRenderer):
    """vLLM's Hugging Face renderer with the template-and-tokenize step of the core."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self._encode_async = make_async(self._encode, executor=self._executor)
        from .known_media import KnownImages

        self.known_images = KnownImages.start(self.model_config.model, _media_pool())
        threshold = return_freed_memory()
        logger.info("apertus: chat renderer in process %d; freed blocks above %d bytes go back to the system",
                    os.getpid(), threshold)

    @cached_property
    def chat_tokenizer(self) -> ChatTokenizer:
        from .processing import _tokenizer_dir

        folder = _tokenizer_dir(self.model_config.tokenizer)
        return ChatTokenizer(self.get_tokenizer().backend_tokenizer, VocabSpec.from_tokenizer_dir(folder))

    def _encode(self, conversation: list[dict[str, Any]], params: Any) -> dict[str, Any]:
        kwargs = params.get_apply_chat_template_kwargs()
        tools = kwargs.get("tools")
        try:
            template = resolve_chat_template(self.get_tokenizer(), kwargs.get("chat_template"), tools,
                                             model_config=self.model_config)
            enc = self.chat_tokenizer.encode_conversation(
                conversation,
                tools=tools,
                add_generation_prompt=kwargs.get("add_generation_prompt", True),
                enable_thinking=kwargs.get("enable_thinking", False),
                continue_assistant_message=kwargs.get("continue_final_message", False),
                template=template,
            )
        except ChatFormatError as exc:  # vLLM answers a ValueError with a 400 naming the problem
            raise ValueError(f"Apertus 1.5 chat format: {exc}") from exc
        except (ValueError, VLLMClientError):
            raise
        except Exception as exc:  # noqa: BLE001 - no request may turn into a 500
            raise _request_error("chat format", exc) from exc
        return {"prompt_token_ids": enc.ids.tolist(), "prompt": enc.text}

    @staticmethod
    def _attach(prompt: dict[str, Any], mm_data: Any, mm_uuids: Any) -> dict[str, Any]:
        if mm_data is not None:
            prompt["multi_modal_data"] = mm_data
        if mm_uuids is not None:
            prompt["multi_modal_uuids"] = mm_uuids
        return prompt

    def _media_options(self, params: Any) -> dict[str, Any] | None:
        """The processor options of this request (``None`` for a model without the processor)."""
        if self.mm_processor is None:
            return None
        return self.mm_processor.info.options(params.mm_processor_kwargs or {})

    def _decode_settings(self, params: Any, options: Mapping[str, Any]) -> str | None:
        """What turns an image's encoded bytes into the encoder's pixels on this request, as the raw-bytes
        index keys it (``None``: the request or server sets the image decoder's own options, and the
        index is not used)."""
        io_kwargs = params.media_io_kwargs or getattr(self.model_config.multimodal_config, "media_io_kwargs", None)
        if (io_kwargs or {}).get("image"):
            return None
        import PIL
        from vllm import envs

        from .processing import _limits_of

        return json.dumps({"decoder": f"PIL {PIL.__version__}, RGB", "max_pixels": envs.VLLM_MAX_IMAGE_PIXELS,
                           "resize_policy": options["resize_policy"], "limits": repr(_limits_of(options))})

    def _shortcut(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        """The raw-bytes index (:mod:`vllm_model.known_media`): every image given as a data URL whose codes
        are known through the index is replaced by an empty image part with a marker uuid of this
        request, so vLLM neither fetches nor decodes it; returns the messages and each marker's ids.

        Nothing is replaced (and the request is not changed) when the lookup is off or not ready, or
        when anything goes wrong here: the full path is always correct.
        """
        try:
            return self._index_lookup(messages, params)
        except Exception as exc:  # noqa: BLE001 - a shortcut never fails a request
            logger.warning("apertus: the raw-bytes index was skipped for a request (%s: %s)", type(exc).__name__, exc)
            return messages, {}

    def _index_lookup(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        from .known_media import OPTION, known_sequence

        known = self.known_images
        if known is None or not known.ready:
            return messages, {}
        try:
            options = self._media_options(params)
        except ValueError:  # a bad option: the processor refuses the request with its message
            return messages, {}
        if options is None or not options[OPTION]:
            return messages, {}
        decode = self._decode_settings(params, options)
        if decode is None:
            return messages, {}
        info = self.mm_processor.info
        nonce = secrets.token_hex(8)
        found: dict[str, Any] = {}
        seen: dict[str, Any] = {}  # one lookup per distinct data URL of the request
        out: list[Any] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            parts: list[Any] = []
            for part in content:
                url = _data_url(part)
                if url is not None and url not in seen:
                    data = _data_url_bytes(url)
                    hit = None if data is None else known.known_bytes(data, decode)
                    seen[url] = None if hit is None else known_sequence(hit[0], hit[1], info, options)
                seq = None if url is None else seen[url]
                if seq is None:
                    parts.append(part)
                    continue
                marker = f"{_SHORTCUT}{nonce}-{len(found)}"
                found[marker] = seq
                parts.append({"type": "image_url", "image_url": None, "uuid": marker})
            out.append({**message, "content": parts} if found else message)
        return (out, found) if found else (messages, {})

    def _known_sequences(self, mm_data: Any, mm_uuids: Any, params: Any,
                         shortcut: Mapping[str, Any]) -> list[Any] | None:
        """The ids of each image of the request whose codes are stored (``None`` per unknown image), or
        ``None`` when none is known (or the lookup is off for this server or request). Images that
        ``shortcut`` replaced take its ids; the others are preprocessed and looked up by their pixels,
        and their encoded bytes are indexed (the next request with the same bytes skips all that)."""
        from .known_media import OPTION, known_sequence
        from .processing import prepared_image

        known = self.known_images
        images = (mm_data or {}).get("image")
        if known is None or not known.ready or images is None:
            return None
        images = images if isinstance(images, list) else [images]
        uuids = (mm_uuids or {}).get("image") if isinstance(mm_uuids, dict) else None
        uuids = uuids if isinstance(uuids, list) else [uuids] * len(images)
        try:
            options = self._media_options(params)
        except ValueError:  # a bad option: the processor refuses the request with its message
            return None
        if options is None or not options[OPTION]:
            return None
        pixels: list[Any] = []
        for img in images:
            pil = getattr(img, "media", img)
            try:
                pixels.append(prepared_image(img, options).pixels if hasattr(pil, "size") else None)
            except Exception:  # noqa: BLE001 - a refused image: the processor names it on the multimodal path
                pixels.append(None)
        info = self.mm_processor.info
        keys, stored = known.lookup_keys(pixels)
        decode = self._decode_settings(params, options)
        sequences: list[Any] = []
        for img, uuid, key, codes in zip(images, uuids, keys, stored, strict=True):
            if isinstance(uuid, str) and uuid in shortcut:
                sequences.append(shortcut[uuid])
                continue
            pil = getattr(img, "media", img)
            size = (pil.size[1], pil.size[0]) if key is not None else None
            raw = getattr(img, "original_bytes", None)
            if decode is not None and key is not None and isinstance(raw, bytes):
                known.remember(raw, decode, key, size)
            sequences.append(None if codes is None else known_sequence(codes, size, info, options))
        return sequences if any(seq is not None for seq in sequences) else None

    def _as_text(self, prompt: dict[str, Any], mm_data: Any, mm_uuids: Any,
                 sequences: list[Any] | None) -> tuple[dict[str, Any], Any, Any]:
        """Write the known images into the prompt's ids and drop them from the request's media."""
        from .known_media import substitute_images

        if sequences is None:
            return prompt, mm_data, mm_uuids
        spec = self.mm_processor.info.spec
        ids = substitute_images(prompt["prompt_token_ids"], spec.id(spec.media_kind("image").placeholder), sequences)
        if ids is None:
            return prompt, mm_data, mm_uuids
        keep = [k for k, seq in enumerate(sequences) if seq is None]

        def kept(group: Any) -> Any:
            out = dict(group)
            items = out.pop("image", None)
            if keep and items is not None:
                items = items if isinstance(items, list) else [items]
                out["image"] = [items[k] for k in keep]
            return out or None

        return ({**prompt, "prompt_token_ids": ids}, kept(mm_data),
                kept(mm_uuids) if isinstance(mm_uuids, dict) else mm_uuids)

    def _render(self, messages: list[Any], params: Any, index: bool = True) -> tuple[list[Any], dict[str, Any]] | None:
        """``render_messages`` (with the raw-bytes shortcut where ``index``); ``None`` when the shortcut's
        images could not be written into the prompt (the caller renders again without it)."""
        messages = lift_reasoning_parts(messages)
        messages, shortcut = self._shortcut(messages, params) if index else (messages, {})
        try:
            conversation, mm_data, mm_uuids = parse_chat_messages(
                messages, self.model_config, content_format="openai",
                media_io_kwargs=params.media_io_kwargs, mm_processor_kwargs=params.mm_processor_kwargs)
        except (ValueError, VLLMClientError):
            raise
        except Exception as exc:  # noqa: BLE001 - an unreadable or unreachable media item is the request's
            raise _request_error("media", exc) from exc
        prompt = self._encode(conversation, params)
        sequences = self._known_sequences(mm_data, mm_uuids, params, shortcut)
        out = self._as_text(prompt, mm_data, mm_uuids, sequences)
        if shortcut and out[0] is prompt:
            return None
        return conversation, self._attach(*out)

    def render_messages(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        done = self._render(messages, params)
        if done is None:  # never expected: the core writes one placeholder per image part
            logger.warning("apertus: the images of a request could not be written into its prompt as ids; "
                           "rendering it again with every image on the multimodal path")
            done = self._render(messages, params, index=False)
        assert done is not None
        return done

    async def _prepare_media(self, mm_data: Any, params: Any) -> None:
        """Preprocess the request's images in the plugin's pool, in parallel (see the module docstring)."""
        from .processing import prepare_image

        images = (mm_data or {}).get("image")
        if images is None:
            return
        images = images if isinstance(images, list) else [images]
        options = self._media_options(params)
        if options is None:
            return
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(_media_pool(), prepare_image, img, options) for img in images
                if img is not None and hasattr(getattr(img, "media", img), "size")]
        for k, job in enumerate(jobs):
            try:
                await job
            except ValueError as exc:
                raise ValueError(f"image {k}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001
                raise _request_error(f"image {k}", exc) from exc

    async def _render_async(self, messages: list[Any], params: Any,
                            index: bool = True) -> tuple[list[Any], dict[str, Any]] | None:
        """``render_messages_async`` (with the raw-bytes shortcut where ``index``); ``None`` as :meth:`_render`."""
        options = self._media_options(params)
        deadline = float(options["media_load_seconds"]) if options else None
        messages = lift_reasoning_parts(messages)
        shortcut: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        if index and self.known_images is not None and self.known_images.ready:
            messages, shortcut = await loop.run_in_executor(_media_pool(), self._shortcut, messages, params)
        loading = asyncio.ensure_future(parse_chat_messages_async(
            messages, self.model_config, content_format="openai",
            media_io_kwargs=params.media_io_kwargs, mm_processor_kwargs=params.mm_processor_kwargs))
        done, _ = await asyncio.wait({loading}, timeout=deadline)
        if not done:
            # refused now; the loading runs out on its own (its threads cannot be stopped) and its result
            # is dropped when it ends: cancelling it would leave the decoded media in reference cycles
            # until the next garbage collection
            loading.add_done_callback(_discard)
            raise ValueError(f"Apertus 1.5 media: the request's media took longer than {deadline:g} s to fetch and "
                             "decode (server option media_load_seconds)")
        try:
            conversation, mm_data, mm_uuids = loading.result()
        except (ValueError, VLLMClientError):
            raise
        except Exception as exc:  # noqa: BLE001 - an unreadable or unreachable media item is the request's
            raise _request_error("media", exc) from exc
        await self._prepare_media(mm_data, params)
        prompt = await self._render_with_timeout(self._encode_async(conversation, params))
        sequences = None
        if self.known_images is not None and mm_data:
            sequences = await loop.run_in_executor(
                _media_pool(), self._known_sequences, mm_data, mm_uuids, params, shortcut)
        out = self._as_text(prompt, mm_data, mm_uuids, sequences)
        if shortcut and out[0] is prompt:
            return None
        return conversation, self._attach(*out)

    async def render_messages_async(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        done = await self._render_async(messages, params)
        if done is None:  # never expected: the core writes one placeholder per image part
            logger.warning("apertus: the images of a request could not be written into its prompt as ids; "
                           "rendering it again with every image on the multimodal path")
            done = await self._render_async(messages, params, index=False)
        assert done is not None
        return done


_SHORTCUT = "apertus-known-image-"


def _data_url(part: Any) -> str | None:
    """The data URL of an ``image_url`` content part (``None``: another part, another URL, or a part
    with the client's own uuid, which keeps vLLM's meaning)."""
    if not isinstance(part, dict) or part.get("type") != "image_url" or part.get("uuid") is not None:
        return None
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) and url.startswith("data:") else None


def _data_url_bytes(url: str) -> bytes | None:
    """The bytes of a base64 data URL, decoded as vLLM's media connector decodes them (``None``: not one)."""
    import pybase64

    spec, sep, data = url[5:].partition(",")
    if not sep or spec.rpartition(";")[2] != "base64":
        return None
    try:
        return pybase64.b64decode(data, validate=True)
    except ValueError:
        return None
