"""The core's image and audio preprocessing against the released transformers port (>=5.24)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from torchvision.transforms.v2 import functional as tvF
from transformers.models.apertus1p5.image_processing_apertus1p5 import Apertus1p5ImageProcessor
from transformers.models.wavtokenizer.feature_extraction_wavtokenizer import WavTokenizerFeatureExtractor

from apertus_plugins.media import audio, image

rng = np.random.default_rng(1234)
SIZES = [(1, 1), (7, 5), (40, 90), (127, 129), (129, 129), (300, 500), (1000, 1000), (1401, 1399), (2000, 1500),
         (3000, 4000), (17, 3000), (3400, 17), (800, 37), (15, 2999)] + [
    tuple(int(v) for v in rng.integers(1, 2500, 2)) for _ in range(40)]


@pytest.fixture(scope="module")
def processor():
    return Apertus1p5ImageProcessor()


@pytest.mark.parametrize("h,w", SIZES)
def test_sizes_and_grids_equal_the_released_processor(processor, h, w):
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError):
            processor(images=[Image.new("RGB", (w, h))])
        with pytest.raises(image.ImageError):
            image.resized_size(h, w)
        return
    got = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_sizes"][0]
    assert [int(v) for v in got] == list(image.resized_size(h, w))
    rows, cols = image.image_grid(h, w)
    assert processor.get_number_of_image_patches(h, w) == rows * cols


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_normalization_equals_the_released_processor_bit_for_bit(processor, mode):
    """Given the same resized pixels, the core's [-1, 1] mapping is the processor's, bit for bit."""
    arr = rng.integers(0, 256, (61, 83, 3), dtype=np.uint8)
    img = Image.fromarray(arr, "RGB").convert(mode)
    ref = processor(images=[img], return_tensors="pt")
    h, w = (int(v) for v in ref["image_sizes"][0])
    resized = tvF.resize(tvF.pil_to_tensor(img.convert("RGB")), [h, w],
                         interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    mine = image.normalize_pixels(resized.permute(1, 2, 0).numpy()).transpose(2, 0, 1)
    np.testing.assert_array_equal(mine, ref["pixel_values"][0].numpy())


PIXEL_SIZES = [s for s in SIZES if max(s) / min(s) <= 200 and s[0] * s[1] <= 2500 * 2500][:30]


@pytest.mark.parametrize("h,w", PIXEL_SIZES)
def test_pixels_equal_the_released_processor_bit_for_bit(processor, h, w):
    """The default policy ("released": torch's uint8 antialiased bicubic, in numpy) reproduces the port."""
    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    smooth = np.cumsum(arr, axis=1, dtype=np.int64) % 256  # structured content beside pure noise
    for a in (arr, smooth.astype(np.uint8)):
        img = Image.fromarray(a, "RGB")
        ref = processor(images=[img], return_tensors="pt")["pixel_values"][0].numpy()
        mine = image.preprocess_image(img)
        assert mine.pixels.shape == ref.shape
        np.testing.assert_array_equal(mine.pixels, ref)


@pytest.mark.parametrize("n", [1, 599, 600, 24_000, 37_123])
def test_audio_normalization_and_code_count_equal_the_feature_extractor(n):
    x = (rng.standard_normal(n) * 0.3).astype(np.float32)
    fe = WavTokenizerFeatureExtractor(normalize_audio=True)
    ref = fe(x, sampling_rate=24_000, return_tensors="np")["input_values"][0, 0]
    np.testing.assert_array_equal(audio.preprocess_audio(x, 24_000), ref)
    assert audio.audio_code_count(n) == fe.get_num_audio_codes(n)
