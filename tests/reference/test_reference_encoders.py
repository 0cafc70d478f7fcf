"""The encoders against the released transformers port (5.24): codes identical, 100%.

Same random weights in both (our tokenizers' state dicts load strictly into the port's models),
random images of varied shapes through the core's preprocessing and random clips of varied
lengths. Each image and clip is compared per item (what the port's model does in
``get_image_tokens``/``get_audio_tokens``) and in same-shape batches (the port's ``encode`` on the
same batch). Also: the precision contract and the batching rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _encoder_oracles import port_audio, port_audio_codes, port_image_codes, port_vision
from PIL import Image

from apertus_plugins.core.media import audio, image
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.encoders import (
    AudioTokenizer,
    AudioTokenizerConfig,
    PrecisionError,
    VisionTokenizer,
    VisionTokenizerConfig,
    audio_ids,
    encode_audio,
    encode_images,
    group_by_shape,
    image_ids,
    precision_scope,
)
from apertus_plugins.testing.random_weights import init_random_weights, random_audio_tokenizer, random_vision_tokenizer

rng = np.random.default_rng(20260)


def _random_image(h: int, w: int) -> np.ndarray:
    """Smooth random colour fields plus noise, uint8 [h, w, 3] (varied codes, not pure noise)."""
    coarse = rng.integers(0, 256, (max(2, h // 40), max(2, w // 40), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BILINEAR), dtype=np.int16)
    return np.clip(base + rng.integers(-30, 31, base.shape), 0, 255).astype(np.uint8)


#: original sizes: tiny (upscaled to the minimum), non-square, odd, wide, tall (1400x1400 has its own test)
IMAGE_SIZES = [(1, 1), (5, 9), (100, 300), (128, 128), (129, 257), (300, 200), (17, 900), (480, 640), (333, 777),
               (1000, 40)]
#: sample counts: very short (below one hop, one sample), around the hop, not multiples of 600
CLIP_LENGTHS = [1, 37, 599, 600, 601, 1199, 1800, 5003, 24_000, 24_000 * 3 + 17]


@pytest.fixture(scope="module")
def vision() -> VisionTokenizer:
    return random_vision_tokenizer(seed=11)


@pytest.fixture(scope="module")
def audio_tok() -> AudioTokenizer:
    return random_audio_tokenizer(seed=12)


@pytest.fixture(scope="module")
def images() -> list[image.PreprocessedImage]:
    return [image.preprocess_image(_random_image(h, w)) for h, w in IMAGE_SIZES]


def _assert_codes(mine: np.ndarray | torch.Tensor, ref: np.ndarray | torch.Tensor, what: str) -> None:
    mine, ref = np.asarray(mine), np.asarray(ref)
    assert mine.shape == ref.shape, f"{what}: shape {mine.shape} != {ref.shape}"
    diff = mine != ref
    assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} codes differ"


def test_vision_codes_equal_the_port_per_image(vision, images):
    port = port_vision(vision)
    grids = encode_images(vision, images, batch_size=1)
    distinct = set()
    for (h, w), pre, grid in zip(IMAGE_SIZES, images, grids, strict=True):
        assert grid.shape == pre.grid
        ref = port_image_codes(port, torch.from_numpy(pre.pixels)[None])[0]
        _assert_codes(grid, ref, f"image {h}x{w} -> {pre.height}x{pre.width}")
        distinct.update(np.unique(grid).tolist())
    assert len(distinct) > 100, f"only {len(distinct)} distinct codes: the test weights are degenerate"


def test_vision_codes_equal_the_port_in_same_shape_batches(vision):
    port = port_vision(vision)
    for h, w, n in [(192, 256, 3), (128, 128, 4)]:
        batch = torch.from_numpy(np.stack([image.preprocess_image(_random_image(h, w)).pixels for _ in range(n)]))
        _assert_codes(vision.encode(batch), port_image_codes(port, batch), f"batch of {n} at {h}x{w}")


def test_released_codebook_size_in_bounded_slices_equals_the_port():
    """131,072 x 256 codebook: the sliced running argmax equals the port's full score matrix."""
    cfg = VisionTokenizerConfig(codebook_size=131_072, embed_dim=256, latent_channels=256, base_channels=32,
                                num_res_blocks=1)
    tok = VisionTokenizer(cfg)
    init_random_weights(tok, seed=5)
    tok.score_budget_bytes = 8 * 2**20  # 256 positions x 131,072 scores = 128 MiB -> 16 slices
    port = port_vision(tok)
    for h, w in [(256, 256), (192, 320)]:
        pixels = torch.from_numpy(image.preprocess_image(_random_image(h, w)).pixels)[None]
        _assert_codes(tok.encode(pixels), port_image_codes(port, pixels), f"released codebook, {h}x{w}")


def test_large_image_in_row_blocks_equals_the_port(vision):
    """A 1400x1400 image (7,569 positions) with a budget that forces blocks of positions."""
    pre = image.preprocess_image(_random_image(1400, 1400))
    assert pre.grid == (87, 87)
    pixels = torch.from_numpy(pre.pixels)[None]
    budget, vision.score_budget_bytes = vision.score_budget_bytes, 512 * 1024
    try:
        got = vision.encode(pixels)
    finally:
        vision.score_budget_bytes = budget
    _assert_codes(got, port_image_codes(port_vision(vision), pixels), "1400x1400")


def _clip(n: int) -> np.ndarray:
    t = np.arange(n) / audio.SAMPLE_RATE
    f = rng.uniform(100, 3000)
    return (0.5 * np.sin(2 * np.pi * f * t * (1 + t)) + 0.2 * rng.standard_normal(n)).astype(np.float32)


def test_audio_codes_equal_the_port_per_clip(audio_tok):
    port = port_audio(audio_tok)
    clips = [audio.preprocess_audio(_clip(n), audio.SAMPLE_RATE) for n in CLIP_LENGTHS]
    clips.append(audio.preprocess_audio(_clip(16_000 + 123), 16_000))  # resampled from 16 kHz
    codes = encode_audio(audio_tok, clips, batch_size=1)
    distinct = set()
    for clip, got in zip(clips, codes, strict=True):
        assert got.shape == (audio.audio_code_count(clip.size),)
        _assert_codes(got, port_audio_codes(port, torch.from_numpy(clip)[None])[0], f"clip of {clip.size} samples")
        distinct.update(got.tolist())
    assert len(distinct) > 30, f"only {len(distinct)} distinct codes: the test weights are degenerate"


def test_audio_codes_equal_the_port_in_same_length_batches(audio_tok):
    port = port_audio(audio_tok)
    for n, b in [(601, 3), (24_000 + 250, 4)]:
        wave = torch.from_numpy(np.stack([audio.preprocess_audio(_clip(n), audio.SAMPLE_RATE) for _ in range(b)]))
        _assert_codes(audio_tok.encode(wave), port_audio_codes(port, wave), f"batch of {b} clips of {n}")
        _assert_codes(audio_tok.encode(wave[:, None]), port_audio_codes(port, wave), "[B, 1, T] input")


def test_encode_helpers_group_by_exact_shape_and_keep_input_order(vision, images, audio_tok):
    shapes = [pre.pixels.shape for pre in images]
    batches = group_by_shape(images, batch_size=2)
    assert sorted(i for b in batches for i in b) == list(range(len(images)))
    for b in batches:
        assert len(b) <= 2 and len({shapes[i] for i in b}) == 1 and b == sorted(b)
    same = [images[3], images[2], images[3], images[3]]  # two shapes, interleaved
    batched = encode_images(vision, same, batch_size=8)
    singles = encode_images(vision, same, batch_size=1)
    for a, b in zip(batched, singles, strict=True):
        _assert_codes(a, b, "batched vs single")
    clips = [_clip(n) for n in (600, 1300, 600, 5)]
    got = encode_audio(audio_tok, clips, batch_size=4)
    assert [g.shape[0] for g in got] == [1, 3, 1, 1]
    _assert_codes(got[2], encode_audio(audio_tok, [clips[2]])[0], "audio order")


def test_ragged_input_is_refused(vision, audio_tok):
    a = image.preprocess_image(_random_image(128, 128)).pixels
    b = image.preprocess_image(_random_image(128, 256)).pixels
    with pytest.raises(ValueError, match="group them by exact shape"):
        vision.encode([a, b])
    with pytest.raises(ValueError, match="group them by exact length"):
        audio_tok.encode([np.zeros(600, np.float32), np.zeros(601, np.float32)])
    with pytest.raises(ValueError, match="multiples of 16"):
        vision.encode(torch.zeros(1, 3, 100, 128))
    with pytest.raises(ValueError, match=r"lie in \[-1, 1\]"):
        vision.encode(torch.full((1, 3, 128, 128), 200.0))


def test_precision_is_the_encoders_own_setting(vision, audio_tok, images):
    """Global flags that lower float32 matmul precision neither change the codes nor survive encode()."""
    pixels = torch.from_numpy(images[4].pixels)[None]
    clip = torch.from_numpy(audio.preprocess_audio(_clip(24_000), audio.SAMPLE_RATE))[None]
    with torch.inference_mode(), precision_scope("float32"):
        ref_img = port_image_codes(port_vision(vision), pixels)
        ref_wav = port_audio_codes(port_audio(audio_tok), clip)
    flags = torch.backends.mkldnn.matmul
    before = (torch.get_float32_matmul_precision(), flags.fp32_precision)
    torch.set_float32_matmul_precision("medium")  # bf16 matmuls on oneDNN
    try:
        lowered = (torch.get_float32_matmul_precision(), flags.fp32_precision)
        _assert_codes(vision.encode(pixels), ref_img, "image under global medium precision")
        _assert_codes(audio_tok.encode(clip), ref_wav, "audio under global medium precision")
        assert (torch.get_float32_matmul_precision(), flags.fp32_precision) == lowered, "flags not restored"
    finally:
        torch.set_float32_matmul_precision(before[0])
        flags.fp32_precision = before[1]


def test_tf32_on_cpu_and_half_precision_are_refused(vision, audio_tok):
    pixels = torch.zeros(1, 3, 128, 128)
    with pytest.raises(PrecisionError, match="tf32.*CUDA"):
        VisionTokenizer(VisionTokenizerConfig.tiny(), precision="tf32").encode(pixels)
    with pytest.raises(PrecisionError, match="unknown precision"):
        AudioTokenizer(AudioTokenizerConfig.tiny(), precision="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(PrecisionError, match="half precision"):
        vision.encode(pixels.to(torch.bfloat16))
    with pytest.raises(PrecisionError, match="half precision"):
        audio_tok.encode(torch.zeros(1, 600, dtype=torch.float16))
    half = AudioTokenizer(AudioTokenizerConfig.tiny()).to(torch.bfloat16)
    with pytest.raises(PrecisionError, match="audio tokenizer weight .*bfloat16"):
        half.encode(torch.zeros(1, 600))
    half_v = VisionTokenizer(VisionTokenizerConfig.tiny()).half()
    with pytest.raises(PrecisionError, match="vision tokenizer weight .*float16"):
        half_v.encode(pixels)


def test_ids_paths_use_the_core_layouts(vision, audio_tok, tmp_path):
    spec = VocabSpec.scaled()
    text_ids = image.byte_text_ids(offset=80)
    img = _random_image(200, 330)
    pre = image.preprocess_image(img)
    ref = port_image_codes(port_vision(vision), torch.from_numpy(pre.pixels)[None])[0].numpy()
    for layout in ("inference", "training"):
        got = image_ids(vision, Image.fromarray(img), spec, layout=layout, text_ids=text_ids)
        assert got.tolist() == image.image_sequence(ref, spec, layout, text_ids).tolist()
        assert image.detect_image_layout(got, spec) == layout
    wave = np.stack([_clip(22_050), _clip(22_050)])  # stereo at 22.05 kHz
    import soundfile as sf

    path = tmp_path / "clip.wav"
    sf.write(path, wave.T, 22_050, subtype="FLOAT")
    clip = audio.preprocess_audio(*audio.load_audio(path))
    ref_a = port_audio_codes(port_audio(audio_tok), torch.from_numpy(clip)[None])[0].numpy()
    expected = audio.audio_sequence(ref_a, spec).tolist()
    assert audio_ids(audio_tok, path, spec).tolist() == expected
    assert audio_ids(audio_tok, path.read_bytes(), spec).tolist() == expected
    assert audio_ids(audio_tok, audio.load_audio(path)[0], spec, sample_rate=22_050).tolist() == expected
    with pytest.raises(ValueError, match="sample_rate"):
        audio_ids(audio_tok, wave, spec)
