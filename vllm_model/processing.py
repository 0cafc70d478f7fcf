"""The multimodal processor of Apertus 1.5 in vLLM: processing info, dummy inputs, processor.

Media arrive through the OpenAI chat API (``image_url`` with http(s) or data URLs,
``input_audio``, ``audio_url``); the chat template renders one ``<|image|>`` or ``<|audio|>`` per
part. The processor preprocesses each item with the core (``media.image.preprocess_image``,
``media.audio.preprocess_audio``: mono, 24 kHz whatever the input rate, -3 dBFS) and replaces
each placeholder with the item's full sequence in the configured layout (the core builds it), the
placeholder id standing at every code position. Only those positions receive embeddings
(``PromptUpdateDetails.select_token_id``): the model's tokenizers turn the pixels and waveforms
into codes there (see :mod:`vllm_model.model`).

Options (``--mm-processor-kwargs`` for the server, ``mm_processor_kwargs`` per request):
``image_layout`` (``"inference"``, the default, or ``"training"``), ``resize_policy``
(``"released"``), ``audio_policy`` (``"released"``), ``media_as_text`` (``true``: images whose codes
the media-code cache holds reach the engine as token ids, :mod:`vllm_model.known_media`). Server options only (a request that sets
one is refused): the media limits of :class:`apertus_plugins.core.media.limits.MediaLimits`
(``max_image_pixels``, ``reduce_above_pixels``, ``min_sample_rate``, ``max_sample_rate``,
``max_channels``, ``max_abs_sample``), ``max_audio_seconds`` (60 on a server) and
``media_load_seconds`` (30: the longest a request's media may take to fetch and decode).

Hostile input stops here, never in the engine: every item is checked before any expensive work
(the core's limits), an audio clip is checked finite and in range before its downmix and
resampling, and any error of the processor is a ``ValueError`` naming the item (vLLM answers
400). The engine only ever receives arrays this processor made and checked. Processing an item
twice gives the same arrays (vLLM's processor cache re-parses the items it has to process): the
data parser only checks, downmixes and resamples (a mono 24 kHz clip passes unchanged); the level
normalization happens once, in the processor.

The placeholders are the vocabulary spec's media kinds and the serving layout the registry's (``image`` and ``audio``); the
processor serves those two, vLLM's own media kinds. A modality added by a plugin renders,
tokenizes and goes through the offline pipeline, but is not served: vLLM refuses its parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import AudioProcessorItems, ImageProcessorItems, MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.core.media import image as media_image
from apertus_plugins.core.media.limits import MediaLimits
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.plugins import serving_layout

__all__ = ["Apertus1p5ProcessingInfo", "Apertus1p5DummyInputsBuilder", "Apertus1p5MultiModalProcessor",
           "DEFAULT_OPTIONS", "SERVER_OPTIONS", "SERVER_LIMITS", "prepared_image", "prepare_image"]

#: The media limits of a server: the core's defaults, clips of at most 60 s.
SERVER_LIMITS = MediaLimits(max_audio_seconds=60.0)
#: Options only the server sets (``--mm-processor-kwargs``); a request may not change them.
SERVER_OPTIONS: dict[str, Any] = {
    **{name: getattr(SERVER_LIMITS, name) for name in MediaLimits.names()},
    "media_load_seconds": 30.0,
}
#: Processor options and their defaults; the image layout is the registry's serving layout (the inference layout).
DEFAULT_OPTIONS: dict[str, Any] = {
    "image_layout": serving_layout("image"),
    "resize_policy": "released",
    "audio_policy": "released",
    # images whose codes the media-code cache holds reach the engine as token ids (vllm_model.known_media)
    "media_as_text": True,
    **SERVER_OPTIONS,
}
#: The attribute of a PIL image that holds its preprocessed pixels, once the renderer prepared them
#: (:func:`prepare_image`), keyed by the policy and limits they were made with.
_PREPARED = "_apertus_prepared"


def _limits_of(options: Mapping[str, Any]) -> MediaLimits:
    return MediaLimits().updated({k: options[k] for k in MediaLimits.names()})


def prepare_image(image: Any, options: Mapping[str, Any]) -> None:
    """Preprocess one image (a PIL image, possibly wrapped in vLLM's ``MediaWithBytes``) and keep the
    result on it: the renderer does this for every image of a request in its own thread pool, in
    parallel, so vLLM's multimodal thread (one per API server, shared by all requests) only picks
    the result up. Raises :class:`~apertus_plugins.core.media.image.ImageError` for a refused image."""
    img = getattr(image, "media", image)
    key = (options["resize_policy"], _limits_of(options))
    if getattr(img, _PREPARED, (None,))[0] != key:
        pre = media_image.preprocess_image(img, options["resize_policy"], key[1])
        try:
            setattr(img, _PREPARED, (key, pre))
        except AttributeError:  # an object that takes no attributes: the processor computes it again
            pass


def prepared_image(image: Any, options: Mapping[str, Any]) -> media_image.PreprocessedImage:
    """The preprocessed pixels of an image: those :func:`prepare_image` kept on it, else computed now."""
    img = getattr(image, "media", image)
    key = (options["resize_policy"], _limits_of(options))
    kept = getattr(img, _PREPARED, None)
    if kept is not None and kept[0] == key:
        return kept[1]
    return media_image.preprocess_image(img, options["resize_policy"], key[1])


def _checked(x: np.ndarray, what: str, ndim: int, bound: float) -> torch.Tensor:
    """The engine's input: a non-empty float32 array of the expected rank, finite, within +-``bound``;
    anything else would be a bug of this processor, refused before the engine sees it."""
    if x.dtype != np.float32 or x.ndim != ndim or x.size == 0 or not np.isfinite(x).all() or np.abs(x).max() > bound:
        raise ValueError(f"{what}: the processor made an invalid array (dtype {x.dtype}, shape {list(x.shape)})")
    return torch.from_numpy(np.ascontiguousarray(x))


@contextlib.contextmanager
def _item(what: str) -> Iterator[None]:
    """Any error while processing one item is that item's: a ``ValueError`` naming it (vLLM: 400)."""
    try:
        yield
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - nothing a request sends may turn into a 500 or an engine error
        raise ValueError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _tokenizer_dir(name: str) -> Path:
    """The served tokenizer's folder: the path itself, or its Hub snapshot (small files only, one lookup rule)."""
    from apertus_plugins.infra.hub import local_path

    return local_path(name, weights=False, what="tokenizer")


class Apertus1p5DataParser(MultiModalDataParser):
    """Audio items become checked mono 24 kHz float32 through the core, from their own sample rate.

    A bare array (no rate) is taken to be 24 kHz already, as the released processor does. The clip
    is checked (length, rate and channels from the numbers, samples finite and in range) before the
    downmix and the resampling; the level normalization waits for the processor, so parsing a
    parsed clip again (vLLM's processor cache does) changes nothing.
    """

    def __init__(self, *args: Any, audio_policy: str = "released", limits: MediaLimits = SERVER_LIMITS,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.audio_policy = audio_policy
        self.limits = limits

    def _parse_audio_data(self, data: Any) -> Any:
        if data is None or self.is_embeddings(data) or isinstance(data, dict):
            return super()._parse_audio_data(data)
        if isinstance(data, tuple) or (isinstance(data, (np.ndarray, torch.Tensor)) and data.ndim == 1) or (
                isinstance(data, list) and data and isinstance(data[0], float)):
            items = [data]
        else:
            items = list(data)
        clips: list[np.ndarray | None] = []
        for k, item in enumerate(items):
            if item is None:
                clips.append(None)
                continue
            with _item(f"audio {k}"):
                wave, rate = self._get_audio_with_sr(item)
                wave = np.asarray(wave.numpy() if isinstance(wave, torch.Tensor) else wave)
                if wave.ndim == 2 and wave.shape[0] > wave.shape[1]:
                    wave = wave.T  # [samples, channels] -> [channels, samples]
                clips.append(media_audio.mono_24k(wave, rate or media_audio.SAMPLE_RATE, self.audio_policy,
                                                  self.limits, name=f"audio {k}"))
        return AudioProcessorItems(clips)


class Apertus1p5ProcessingInfo(BaseProcessingInfo):
    """What the processor needs to know: the vocabulary layout, the header tokenizer, the options."""

    @cached_property
    def tokenizer_dir(self) -> Path:
        return _tokenizer_dir(self.ctx.model_config.tokenizer)

    @cached_property
    def spec(self) -> VocabSpec:
        return VocabSpec.from_tokenizer_dir(self.tokenizer_dir)

    @cached_property
    def chat_tokenizer(self) -> ChatTokenizer:
        return ChatTokenizer(self.tokenizer_dir, self.spec)

    def options(self, request_kwargs: Mapping[str, object] | None = None) -> dict[str, Any]:
        """The processor options: defaults, then ``--mm-processor-kwargs``, then the request's.

        The server options (:data:`SERVER_OPTIONS`: the media limits) come from the server alone; a
        request that sets one to another value is refused, naming it.
        """
        request = dict(request_kwargs or {})
        merged = self.ctx.get_merged_mm_kwargs(request)
        unknown = sorted(k for k in merged if k not in DEFAULT_OPTIONS and not k.endswith("_kwargs"))
        if unknown:
            raise ValueError(f"unknown Apertus 1.5 processor option(s) {unknown}; options are {sorted(DEFAULT_OPTIONS)}")
        server = dict(self.ctx.get_merged_mm_kwargs({}))
        changed = sorted(k for k in SERVER_OPTIONS if k in request and request[k] != server.get(k, SERVER_OPTIONS[k]))
        if changed:
            raise ValueError(f"{', '.join(changed)}: a server option (--mm-processor-kwargs); a request cannot "
                             "change it")
        opts = {**DEFAULT_OPTIONS, **{k: v for k, v in merged.items() if k in DEFAULT_OPTIONS}}
        if opts["image_layout"] not in media_image.LAYOUTS:
            raise ValueError(f"unknown image_layout {opts['image_layout']!r}; layouts are {sorted(media_image.LAYOUTS)}")
        if opts["resize_policy"] not in media_image.POLICIES:
            raise ValueError(f"unknown resize_policy {opts['resize_policy']!r}; policies are "
                             f"{sorted(media_image.POLICIES)}")
        if opts["audio_policy"] not in media_audio.AUDIO_POLICIES:
            raise ValueError(f"unknown audio_policy {opts['audio_policy']!r}; policies are "
                             f"{sorted(media_audio.AUDIO_POLICIES)}")
        if not isinstance(opts["media_as_text"], bool):
            raise ValueError(f"media_as_text must be true or false, got {opts['media_as_text']!r}")
        _limits_of(opts)  # validated: positive finite numbers
        return opts

    def limits(self, options: Mapping[str, Any] | None = None) -> MediaLimits:
        """The media limits of this server (its options)."""
        return _limits_of(self.options() if options is None else options)

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        return {"text_kwargs": set(), "images_kwargs": set(), "audio_kwargs": set()}

    def get_data_parser(self) -> MultiModalDataParser:
        opts = self.options()
        return Apertus1p5DataParser(expected_hidden_size=self._get_expected_hidden_size(),
                                    audio_policy=opts["audio_policy"], limits=_limits_of(opts))

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "audio": None}

    # ------------------------------------------------------------------ sequences
    def image_sequence(self, height: int, width: int, options: Mapping[str, Any]) -> np.ndarray:
        """The placeholder sequence of an image of this original size (codes at ``<|image|>``)."""
        rows, cols = media_image.image_grid(height, width, options["resize_policy"])
        return media_image.image_placeholder_sequence(rows, cols, self.spec, options["image_layout"],
                                                      self.chat_tokenizer.char_ids)

    def audio_sequence(self, num_samples: int, options: Mapping[str, Any]) -> np.ndarray:
        """The placeholder sequence of a 24 kHz clip of ``num_samples`` samples."""
        limit = float(options["max_audio_seconds"])
        if num_samples > limit * media_audio.SAMPLE_RATE:
            raise ValueError(f"an audio clip of {num_samples / media_audio.SAMPLE_RATE:.1f} s is longer than the "
                             f"{limit:g} s this server accepts (server option max_audio_seconds)")
        return media_audio.audio_placeholder_sequence(media_audio.audio_code_count(num_samples), self.spec)

    def max_image_side(self, budget: int) -> int:
        """The largest square image (pixels per side) whose sequence fits in ``budget`` ids (at least 16)."""
        opts = self.options()
        side = media_image.MAX_PIXELS
        best = 16
        lo, hi = 1, int(side ** 0.5) // 16 + 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if len(self.image_sequence(16 * mid, 16 * mid, opts)) <= budget:
                best, lo = 16 * mid, mid + 1
            else:
                hi = mid - 1
        return best

    def max_audio_samples(self, budget: int) -> int:
        opts = self.options()
        codes = min(int(float(opts["max_audio_seconds"]) * media_audio.SAMPLE_RATE) // media_audio.HOP, budget - 2)
        return max(1, codes) * media_audio.HOP

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        opts = self.options()
        side = self.max_image_side(seq_len)
        return {"image": len(self.image_sequence(side, side, opts)),
                "audio": len(self.audio_sequence(self.max_audio_samples(seq_len), opts))}


class Apertus1p5DummyInputsBuilder(BaseDummyInputsBuilder[Apertus1p5ProcessingInfo]):
    """The largest image and clip that fit the context, for vLLM's memory profiling."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        spec = self.info.spec
        return "".join(spec.literal(spec.media_kind(kind).placeholder) * mm_counts.get(kind, 0)
                       for kind in ("image", "audio"))

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any) -> dict[str, Any]:
        side = self.info.max_image_side(seq_len)
        samples = self.info.max_audio_samples(seq_len)
        return {
            "image": self._get_dummy_images(width=side, height=side, num_images=mm_counts.get("image", 0),
                                            overrides=(mm_options or {}).get("image")),
            "audio": [(np.zeros(samples, dtype=np.float32), media_audio.SAMPLE_RATE)] * mm_counts.get("audio", 0),
        }


class Apertus1p5MultiModalProcessor(BaseMultiModalProcessor[Apertus1p5ProcessingInfo]):
    """Pixels and waveforms through the core; each placeholder becomes the item's sequence."""

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        opts = self.info.options(hf_kwargs)
        out: dict[str, Any] = {}
        limits = _limits_of(opts)
        images = hf_data.get("images") or []
        if images:
            pixels = []
            for k, img in enumerate(images):
                with _item(f"image {k}"):
                    pixels.append(_checked(prepared_image(img, opts).pixels, f"image {k}", 3, 1.0))
            out["pixel_values"] = pixels
        clips = hf_data.get("audio") or []
        if clips:
            values = []
            for k, clip in enumerate(clips):
                with _item(f"audio {k}"):
                    self.info.audio_sequence(len(clip), opts)  # length check, with a clear message
                    # a parsed clip: checked again, passed through unchanged; then normalized, once
                    x = media_audio.mono_24k(clip, media_audio.SAMPLE_RATE, opts["audio_policy"], limits,
                                             name=f"audio {k}")
                    values.append(_checked(media_audio.normalize_audio(x, opts["audio_policy"]), f"audio {k}", 1,
                                           limits.max_abs_sample))
            out["input_values"] = values
        return BatchFeature(out)

    def _get_mm_fields_config(self, hf_inputs: BatchFeature,
                              hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping[str, MultiModalFieldConfig]:
        return {"pixel_values": MultiModalFieldConfig.batched("image"),
                "input_values": MultiModalFieldConfig.batched("audio")}

    def _get_prompt_updates(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        opts = self.info.options(hf_processor_mm_kwargs)
        spec = self.info.spec
        image_id, audio_id = (spec.id(spec.media_kind(kind).placeholder) for kind in ("image", "audio"))

        def image_replacement(item_idx: int) -> PromptUpdateDetails[list[int]]:
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
            seq = self.info.image_sequence(size.height, size.width, opts).tolist()
            return PromptUpdateDetails.select_token_id(seq, embed_token_id=image_id)

        def audio_replacement(item_idx: int) -> PromptUpdateDetails[list[int]]:
            clip = mm_items.get_items("audio", AudioProcessorItems).get(item_idx)
            seq = self.info.audio_sequence(len(clip), opts).tolist()
            return PromptUpdateDetails.select_token_id(seq, embed_token_id=audio_id)

        return [PromptReplacement(modality="image", target=[image_id], replacement=image_replacement),
                PromptReplacement(modality="audio", target=[audio_id], replacement=audio_replacement)]
