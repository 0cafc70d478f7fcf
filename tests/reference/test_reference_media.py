"""The core's media preprocessing and placeholders against the released transformers port (>=5.24).

Everything here is an exact comparison: sizes, grids, ``pixel_values`` bit for bit (float32 array
equality), normalized audio bit for bit, placeholder ids equal. On a mismatch the message states the
maximum absolute difference and the fraction of differing values.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.apertus1p5.image_processing_apertus1p5 import Apertus1p5ImageProcessor
from transformers.models.apertus1p5.processing_apertus1p5 import Apertus1p5Processor
from transformers.models.wavtokenizer.feature_extraction_wavtokenizer import WavTokenizerFeatureExtractor

import apertus_plugins
from apertus_plugins.core.media import audio, image
from apertus_plugins.core.vocab import VocabSpec

rng = np.random.default_rng(1234)

#: (height, width): tiny (upscaled to the minimum budget), odd, near the budget, huge (downscaled),
#: aspect ratios at and near the limit of 200, plus random ones.
SIZES = [(1, 1), (2, 3), (7, 5), (13, 1), (40, 90), (127, 129), (129, 129), (300, 500), (1000, 1000), (1008, 1000),
         (1401, 1399), (1400, 1400), (2000, 1500), (3000, 4000), (4321, 777), (17, 3000), (3400, 17), (800, 37),
         (15, 2999), (16, 3200), (3200, 16), (10, 2000), (1, 200), (200, 1), (20, 3990), (511, 3)] + [
    tuple(int(v) for v in rng.integers(1, 2500, 2)) for _ in range(40)]
OVER_LIMIT = [(1, 201), (10, 2001), (3001, 15), (16, 3217)]


def test_this_checkout_is_under_test():
    from pathlib import Path

    assert Path(apertus_plugins.__file__).resolve().parents[1] == Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def processor() -> Apertus1p5ImageProcessor:
    return Apertus1p5ImageProcessor()


def _assert_identical(mine: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert mine.shape == ref.shape, f"{what}: shape {mine.shape} != {ref.shape}"
    assert mine.dtype == ref.dtype, f"{what}: dtype {mine.dtype} != {ref.dtype}"
    diff = mine != ref
    if diff.any():
        err = np.abs(mine.astype(np.float64) - ref.astype(np.float64)).max()
        pytest.fail(f"{what}: {diff.mean():.3%} of {diff.size} values differ, max abs difference {err:g}")


@pytest.mark.parametrize("h,w", SIZES + OVER_LIMIT)
def test_sizes_and_grids_equal_the_released_processor(processor, h, w):
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            processor(images=[Image.new("RGB", (w, h))])
        with pytest.raises(image.ImageError, match=f"{h}x{w}"):
            image.resized_size(h, w)
        return
    got = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_sizes"][0]
    assert [int(v) for v in got] == list(image.resized_size(h, w))
    rows, cols = image.image_grid(h, w)
    assert processor.get_number_of_image_patches(h, w) == rows * cols


def _content(h: int, w: int, kind: str, channels: int = 3) -> np.ndarray:
    if kind == "noise":
        return rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x // 7 + y // 5) % 2) * 255,
                     (x + y) % 256], axis=-1)
    return base[..., :channels].astype(np.uint8)


PIXEL_SIZES = [s for s in SIZES if max(s) / min(s) <= 200]


@pytest.mark.parametrize("h,w", PIXEL_SIZES)
@pytest.mark.parametrize("kind", ["noise", "structured"])
def test_pixels_equal_the_released_processor_bit_for_bit(processor, h, w, kind):
    """The default policy ("released": torch's uint8 antialiased bicubic, in numpy) reproduces the port."""
    img = Image.fromarray(_content(h, w, kind), "RGB")
    ref = processor(images=[img], return_tensors="pt")
    mine = image.preprocess_image(img)
    assert [mine.height, mine.width] == [int(v) for v in ref["image_sizes"][0]]
    _assert_identical(mine.pixels, ref["pixel_values"][0].numpy(), f"{h}x{w} {kind}")


def _mode_image(mode: str, h: int, w: int) -> Image.Image:
    if mode == "RGBA":
        return Image.fromarray(_content(h, w, "noise", 4), "RGBA")
    if mode == "LA":
        return Image.fromarray(_content(h, w, "noise", 4), "RGBA").convert("LA")
    if mode == "P-transparent":
        img = Image.fromarray(_content(h, w, "structured"), "RGB").convert("P", palette=Image.Palette.ADAPTIVE)
        img.info["transparency"] = int(np.asarray(img)[0, 0])
        return img
    if mode == "P":
        return Image.fromarray(_content(h, w, "noise"), "RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    return Image.fromarray(_content(h, w, "noise"), "RGB").convert(mode)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "P-transparent", "CMYK", "I", "1"])
@pytest.mark.parametrize("h,w", [(61, 83), (700, 2900), (33, 7)])
def test_every_pil_mode_equals_the_released_processor(processor, mode, h, w):
    img = _mode_image(mode, h, w)
    ref = processor(images=[img], return_tensors="pt")["pixel_values"][0].numpy()
    _assert_identical(image.preprocess_image(img).pixels, ref, f"mode {mode} {h}x{w}")


@pytest.mark.parametrize("shape", [(45, 67), (45, 67, 1), (45, 67, 3), (45, 67, 4), (3, 45, 67), (4, 45, 67),
                                   (1, 45, 67)])
def test_arrays_equal_the_released_processor(processor, shape):
    arr = rng.integers(0, 256, shape, dtype=np.uint8)
    # the processor takes no bare [H, W] array in a list; the core reads one as a single channel
    ref_input = arr[:, :, None] if arr.ndim == 2 else arr
    ref = processor(images=[ref_input], return_tensors="pt")["pixel_values"][0].numpy()
    _assert_identical(image.preprocess_image(arr).pixels, ref, f"array {shape}")


def test_files_equal_the_released_processor(processor, tmp_path):
    from transformers.image_utils import load_image

    arr = _content(90, 130, "structured")
    path = tmp_path / "pic.png"
    Image.fromarray(arr).save(path)
    ref = processor(images=[load_image(str(path))], return_tensors="pt")["pixel_values"][0].numpy()
    _assert_identical(image.preprocess_image(path).pixels, ref, "png file")


def test_pil_kernel_is_pillows_bicubic():
    img = Image.fromarray(_content(300, 211, "noise"), "RGB")
    got = image.preprocess_image(img, policy="pil")
    h, w = image.resized_size(300, 211)
    want = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32).transpose(2, 0, 1)
    _assert_identical(got.pixels, (want - np.float32(127.5)) / np.float32(127.5), "pil policy")


AUDIO_CASES = {
    "short": (rng.standard_normal(1) * 0.3).astype(np.float32),
    "hop-1": (rng.standard_normal(599) * 0.3).astype(np.float32),
    "hop": (rng.standard_normal(600) * 0.3).astype(np.float32),
    "one-second": (rng.standard_normal(24_000) * 0.3).astype(np.float32),
    "odd": (rng.standard_normal(37_123) * 0.01).astype(np.float32),
    "loud": (rng.standard_normal(5000) * 40).astype(np.float32),
    "silent": np.zeros(1200, np.float32),
    "tiny": np.full(700, 1e-12, np.float32),
}


@pytest.mark.parametrize("case", list(AUDIO_CASES))
def test_audio_normalization_and_code_count_equal_the_feature_extractor(case):
    x = AUDIO_CASES[case]
    fe = WavTokenizerFeatureExtractor(normalize_audio=True)
    ref = fe(x, sampling_rate=24_000, return_tensors="np")["input_values"][0, 0]
    _assert_identical(audio.preprocess_audio(x, 24_000), ref, f"audio {case}")
    _assert_identical(audio.peak_normalize(x), ref, f"peak_normalize {case}")
    assert audio.audio_code_count(x.size) == fe.get_num_audio_codes(x.size)


@pytest.fixture(scope="module")
def released_processor(full_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(full_tokenizer_dir)
    return Apertus1p5Processor(Apertus1p5ImageProcessor(), WavTokenizerFeatureExtractor(normalize_audio=True), tok)


@pytest.mark.parametrize("h,w", [(200, 300), (48, 64), (1000, 37), (2000, 1500), (16, 3200)])
def test_image_placeholder_equals_the_released_processor(released_processor, full_tokenizer_dir, h, w):
    """``replace_image_token`` + tokenization == ``image_placeholder_sequence`` in the inference layout."""
    spec = VocabSpec.from_tokenizer_dir(full_tokenizer_dir)
    tok = released_processor.tokenizer
    ids = released_processor(text=f"look {tok.image_token}", images=[Image.new("RGB", (w, h))],
                             return_tensors="np")["input_ids"][0].tolist()
    start = ids.index(spec.id("img_start"))
    rows, cols = image.image_grid(h, w)
    mine = image.image_placeholder_sequence(rows, cols, spec, "inference",
                                            text_ids=image.text_ids_from_tokenizer(full_tokenizer_dir))
    assert ids[start:] == mine.tolist()
    assert image.detect_image_layout(ids, spec) == "inference"


@pytest.mark.parametrize("n", [1, 600, 601, 24_000])
def test_audio_placeholder_equals_the_released_processor(released_processor, full_tokenizer_dir, n):
    spec = VocabSpec.from_tokenizer_dir(full_tokenizer_dir)
    tok = released_processor.tokenizer
    x = (rng.standard_normal(n) * 0.1).astype(np.float32)
    ids = released_processor(text=f"hear {tok.audio_token}", audio=[x], return_tensors="np")["input_ids"][0].tolist()
    start = ids.index(spec.id("audio_start"))
    assert ids[start:] == audio.audio_placeholder_sequence(audio.audio_code_count(n), spec).tolist()
