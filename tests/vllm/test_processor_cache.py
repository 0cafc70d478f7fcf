"""vLLM's multimodal processor cache keeps the processor's output bit-identical.

On a cache miss vLLM re-parses the items it already parsed (``_get_cache_missing_items``); a data
parser that normalizes would normalize twice. The processor runs here in-process, as the API server
runs it, without a cache, with the processor-only cache and with the server's default sender cache
(``LruKeyReplicatedSenderCache``), on random images and clips (rates, channels, levels), for text
and token-id prompts; outputs and placeholder ranges must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_config(checkpoint):
    import vllm_model

    vllm_model.register()
    from vllm.config import ModelConfig

    return ModelConfig(model=str(checkpoint), max_model_len=4096, limit_mm_per_prompt={"image": 3, "audio": 3})


@pytest.fixture(scope="module")
def processor(model_config):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.create_processor(model_config)


def _clips(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, int]]:
    out = []
    for _ in range(n):
        rate = int(rng.choice([8_000, 16_000, 22_050, 24_000, 44_100, 48_000]))
        seconds = float(rng.uniform(0.05, 1.5))
        shape = (int(rate * seconds),) if rng.random() < 0.5 else (int(rng.integers(2, 4)), int(rate * seconds))
        level = float(10 ** rng.uniform(-3, 0.5))
        out.append(((rng.standard_normal(shape) * level).astype(np.float32), rate))
    return out


def _images(rng: np.random.Generator, n: int) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(8, 300)), int(rng.integers(8, 300)), 3),
                                         dtype=np.uint8)) for _ in range(n)]


def _apply(processor, prompt: list[int], mm_data: dict, cache) -> object:
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    items = processor.info.parse_mm_data(mm_data)
    return processor.apply(ProcessorInputs(prompt, items, hf_processor_mm_kwargs={}, cache=cache), TimingContext())


def _data(result, modality: str, field: str) -> list[torch.Tensor | None]:
    out = []
    for item in result["mm_kwargs"].get(modality, []):
        out.append(None if item is None else item[field].data)
    return out


def _same(a, b) -> None:
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert a["mm_placeholders"] == b["mm_placeholders"]
    assert a["mm_hashes"] == b["mm_hashes"]
    for modality, field in (("image", "pixel_values"), ("audio", "input_values")):
        for x, y in zip(_data(a, modality, field), _data(b, modality, field), strict=True):
            if x is not None and y is not None:  # a sender cache sends an item it sent before as None
                assert x.dtype == y.dtype and torch.equal(x, y), (modality, (x - y).abs().max())


@pytest.mark.parametrize("seed", range(6))
def test_the_processor_cache_keeps_images_and_clips_bit_identical(processor, model_config, seed):
    from vllm.multimodal.cache import LruKeyReplicatedSenderCache, MultiModalProcessorOnlyCache

    rng = np.random.default_rng(seed)
    spec = processor.info.spec
    tok = processor.info.ctx.tokenizer
    n_img, n_aud = int(rng.integers(0, 3)), int(rng.integers(1, 3))
    mm_data = {"image": _images(rng, n_img), "audio": _clips(rng, n_aud)}
    # a text prompt (tokenized as the completion API does) and the same placeholders as token ids
    text = "Look: " + spec.literal("image") * n_img + " and listen: " + spec.literal("audio") * n_aud
    prompts = [tok.encode(text, add_special_tokens=False),
               [spec.bos_id] + [spec.id("image")] * n_img + [7, 8] + [spec.id("audio")] * n_aud + [9]]
    for prompt in prompts:
        plain = _apply(processor, prompt, mm_data, None)
        for cache in (MultiModalProcessorOnlyCache(model_config), LruKeyReplicatedSenderCache(model_config)):
            first = _apply(processor, prompt, mm_data, cache)  # every item a miss: parsed again by vLLM
            _same(plain, first)
            again = _apply(processor, prompt, mm_data, cache)  # every item a hit
            _same(plain, again)


def test_parsing_a_parsed_clip_changes_nothing(processor):
    """What the cache relies on: the data parser's output, parsed again, is the same array."""
    rng = np.random.default_rng(7)
    for wave, rate in _clips(rng, 12):
        once = processor.info.parse_mm_data({"audio": [(wave, rate)]})["audio"].get(0)
        twice = processor.info.parse_mm_data({"audio": [once]})["audio"].get(0)
        assert once.dtype == np.float32 and np.array_equal(once, twice)


def test_limits_are_server_options_a_request_cannot_change(processor):
    from vllm_model.processing import SERVER_OPTIONS

    opts = processor.info.options({})
    assert {k: opts[k] for k in SERVER_OPTIONS} == SERVER_OPTIONS  # the defaults: core limits, 60 s clips
    assert processor.info.options({"max_image_pixels": SERVER_OPTIONS["max_image_pixels"]})  # unchanged: fine
    for key, value in (("max_image_pixels", 10**12), ("max_abs_sample", 1e38), ("max_audio_seconds", 3600)):
        with pytest.raises(ValueError, match=f"^{key}: a server option"):
            processor.info.options({key: value})
