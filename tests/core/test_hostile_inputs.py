"""Hostile input to the core: media decoders, the chat normalizer, the renderer and the tokenizer.

Every input gives a result or the documented error (``ImageError``, ``AudioError``,
``ChatFormatError``, all ``ValueError``), never another exception, within a time bound per input
size; the limits of :mod:`apertus_plugins.core.media.limits` hold before any expensive work. Property
tests (hypothesis) run a bounded number of examples so the suite stays fast.
"""

from __future__ import annotations

import io
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
import scipy.signal  # noqa: F401 - imported here, not inside the first timed call
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from apertus_plugins.core.chat import ChatFormatError, ChatTokenizer, render
from apertus_plugins.core.media import audio, image
from apertus_plugins.core.media.limits import DEFAULT_LIMITS, MediaLimits, prereduce_factor
from apertus_plugins.testing.references import tap_loop_resize

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def _within(seconds: float, start: float) -> None:
    """A generous bound per input (a hang or a blow-up fails it; a busy shared machine does not)."""
    seconds *= 3
    assert time.perf_counter() - start < seconds, f"took {time.perf_counter() - start:.2f} s (bound {seconds} s)"


def _encoded(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels, with one tiny (wrong) data chunk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


# ---------------------------------------------------------------- images
SAMPLE = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
ENCODED = {fmt: _encoded(SAMPLE, fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")}


def _image_or_error(data) -> None:
    start = time.perf_counter()
    try:
        out = image.preprocess_image(data)
    except image.ImageError:
        pass
    else:
        assert out.pixels.dtype == np.float32 and np.isfinite(out.pixels).all()
        assert out.pixels.shape == (3, out.height, out.width) and np.abs(out.pixels).max() <= 1.0
    _within(5.0, start)


@FAST
@given(data=st.binary(max_size=4096))
def test_random_bytes_are_an_image_or_an_image_error(data):
    _image_or_error(data)


@FAST
@given(fmt=st.sampled_from(sorted(ENCODED)), cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1),
                                                                                             st.integers(0, 255)),
                                                                                   max_size=4))
def test_truncated_and_corrupted_files_are_an_image_or_an_image_error(fmt, cut, flips):
    data = bytearray(ENCODED[fmt][: max(1, int(len(ENCODED[fmt]) * cut))])
    for where, value in flips:
        data[min(len(data) - 1, int(where * len(data)))] = value
    _image_or_error(bytes(data))


@pytest.mark.parametrize("width,height", [(100_000, 100_000), (8193, 8192), (7, 10**8), (2**31 - 1, 2**31 - 1)])
def test_images_above_the_limit_are_refused_from_their_header_before_decoding(width, height):
    start = time.perf_counter()
    with pytest.raises(image.ImageError, match=r"<\d+ bytes>: .*pixels"):
        image.preprocess_image(_png_header(width, height))
    _within(1.0, start)  # nothing of the claimed size is ever allocated


@FAST
@given(shape=st.tuples(st.integers(0, 40), st.integers(0, 40), st.sampled_from([None, 1, 2, 3, 4, 5])),
       dtype=st.sampled_from([np.uint8, np.float32, np.int64, np.bool_]))
def test_arrays_of_any_shape_and_dtype_are_an_image_or_an_image_error(shape, dtype):
    h, w, c = shape
    arr = np.zeros((h, w) if c is None else (h, w, c), dtype=dtype)
    _image_or_error(arr)


def test_the_chunked_resize_is_bit_identical_to_the_tap_loop(monkeypatch):
    """The exact resize runs in chunks of whole rows (bounded memory): any chunking, any size, the
    same bytes as the straightforward int32 tap loop of torch's fixed-point antialiased bicubic."""
    rng = np.random.default_rng(5)
    for chunk in (1, 97, 1 << 22):
        monkeypatch.setattr(image, "_CHUNK_ELEMENTS", chunk)
        for _ in range(12):
            h, w = (int(v) for v in rng.integers(1, 300, 2))
            rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            size = (int(rng.integers(1, 400)), int(rng.integers(1, 400)))
            want = tap_loop_resize(tap_loop_resize(rgb, size[1], 1), size[0], 0)
            assert np.array_equal(image._torch_aa_bicubic(rgb, size), want), (h, w, size, chunk)


SMALL = MediaLimits(reduce_above_pixels=40_000)
#: a small pixel budget, so that a test-sized image is many times its resized size
BUDGET = image.ResizePolicy("test-budget", min_pixels=64 * 64, max_pixels=128 * 128)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("orientation", [1, 6])
def test_pre_reduced_images_keep_the_grid_of_their_original_size(fmt, orientation):
    """Above ``reduce_above_pixels`` an image is reduced cheaply first (JPEG draft, Image.reduce): its
    grid is still the original size's, its pixels close to the exact path's."""
    h, w = 900, 1300
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encoded(arr, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    shown = (w, h) if orientation == 6 else (h, w)  # orientation 6 turns the picture by 90 degrees
    assert prereduce_factor(*shown, image.resized_size(*shown, BUDGET), SMALL) > 1
    reduced = image.preprocess_image(data, BUDGET, limits=SMALL)
    exact = image.preprocess_image(data, BUDGET)  # the default limits: 1.2 megapixels stay exact
    assert reduced.grid == exact.grid == image.image_grid(*shown, BUDGET)
    assert reduced.pixels.shape == exact.pixels.shape
    assert np.abs(reduced.pixels - exact.pixels).mean() < 0.02


def test_images_at_or_below_the_threshold_are_not_reduced():
    assert prereduce_factor(4000, 4000, image.resized_size(4000, 4000)) == 1  # 16 MP: bit-exact path
    assert prereduce_factor(4001, 4000, image.resized_size(4001, 4000)) == 1  # above, but no factor 2 fits
    assert prereduce_factor(8192, 8192, image.resized_size(8192, 8192)) == 2
    assert DEFAULT_LIMITS.max_image_pixels == 8192 * 8192


def test_apertus_encode_sniffs_a_bomb_as_an_image_and_reports_it(tmp_path):
    """``apertus encode`` identified files with Pillow, whose decompression-bomb error ended the run."""
    import argparse

    from apertus_plugins.cli.encode import _prepare, sniff_modality

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_header(20_000, 20_000))
    assert sniff_modality(bomb) == "image"
    with pytest.raises(image.ImageError, match="bomb.png"):
        _prepare(bomb, argparse.Namespace(image_policy="released", audio_policy="released"))


# ---------------------------------------------------------------- audio
def _wav(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@FAST
@given(samples=st.lists(floats32, min_size=0, max_size=300), channels=st.integers(1, 3),
       rate=st.one_of(st.integers(-5, 10**7), st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000])))
def test_any_samples_and_rate_are_a_clip_or_an_audio_error(samples, channels, rate):
    x = np.asarray(samples, dtype=np.float32)
    x = x[: len(x) - len(x) % channels].reshape(channels, -1) if channels > 1 else x
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an overflow or invalid value inside is a failure too
        try:
            out = audio.preprocess_audio(x, rate)
        except audio.AudioError:
            pass
        else:
            assert out.dtype == np.float32 and out.ndim == 1 and np.isfinite(out).all() and np.abs(out).max() <= 1
    _within(5.0, start)


@pytest.mark.parametrize("value,words", [(np.nan, "non-finite"), (np.inf, "non-finite"), (-np.inf, "non-finite"),
                                         (3.3e38, "beyond"), (1e30, "beyond")])
def test_non_finite_and_overflowing_samples_are_refused_before_downmix_and_resampling(value, words):
    stereo = np.zeros((2, 16_000), dtype=np.float32)
    stereo[:, 100] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(audio.AudioError, match=f"clip 3: .*{words}"):
            audio.preprocess_audio(stereo, 16_000, name="clip 3")
        wave, rate = audio.load_audio(_wav(stereo.T, 16_000))
        with pytest.raises(audio.AudioError, match=words):
            audio.preprocess_audio(wave, rate)


@pytest.mark.parametrize("rate,frames,words", [(1, 1000, "sample rate 1 Hz is outside"), (400_000, 10, "sample rate 400,000"),
                                               (1000, 3_600_001, "longer than the 3600 s")])
def test_rate_tricks_are_refused_from_the_header_numbers(rate, frames, words):
    start = time.perf_counter()
    with pytest.raises(audio.AudioError, match=words):
        audio.preprocess_audio(np.zeros(frames, np.float32), rate)
    data = _wav(np.zeros(min(frames, 10), np.float32), rate)
    if frames <= 10:
        with pytest.raises(audio.AudioError, match=words):
            audio.load_audio(data)  # refused from the file's header, before its samples are read
    _within(2.0, start)


@FAST
@given(samples=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=400), channels=st.integers(1, 2),
       rate=st.sampled_from([8000, 16000, 22050, 24000, 44100]))
def test_mono_24k_twice_is_mono_24k_once(samples, channels, rate):
    """What vLLM's processor cache relies on: checking, downmixing and resampling a clip that is already
    mono at 24 kHz changes nothing."""
    x = np.asarray(samples, dtype=np.float32)
    x = x[: len(x) - len(x) % channels].reshape(channels, -1) if channels > 1 and len(x) >= channels else x
    once = audio.mono_24k(x, rate)
    assert np.array_equal(audio.mono_24k(once, audio.SAMPLE_RATE), once)
    assert np.array_equal(audio.normalize_audio(once), audio.preprocess_audio(x, rate))


# ---------------------------------------------------------------- the chat normalizer and the renderer
any_text = st.text(alphabet=st.characters(), max_size=40)  # every code point: surrogates and private use too
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False), any_text)
json_like = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(any_text, inner, max_size=4)),
                         max_leaves=25)
parts = st.one_of(any_text, st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio",
                                                                            "thinking", "video", "image"]),
                                                   "text": any_text, "thinking": any_text}), json_like)
contents = st.one_of(st.none(), any_text, st.lists(parts, max_size=4), st.fixed_dictionaries({"parts": st.lists(parts)}),
                     json_like)
messages_st = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]), "content": contents},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": any_text, "arguments": st.one_of(any_text, json_like)})}), max_size=2),
        "reasoning_content": any_text}), max_size=5)
schemas = st.recursive(st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "integer", "boolean",
                                                                       "object", "array", "null", "mystery"])},
                                             optional={"description": any_text, "enum": st.lists(scalars, max_size=3),
                                                       "default": json_like, "nullable": st.booleans()}),
                       lambda inner: st.one_of(
                           st.fixed_dictionaries({"type": st.just("object"),
                                                  "properties": st.dictionaries(any_text, inner, max_size=3)},
                                                 optional={"required": st.lists(any_text, max_size=2)}),
                           st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
                           st.fixed_dictionaries({"oneOf": st.lists(inner, max_size=3)})), max_leaves=12)
tools_st = st.one_of(st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": any_text}, optional={"description": st.one_of(st.none(), any_text), "parameters": schemas})}),
    json_like), max_size=3))
flags = st.one_of(st.booleans(), st.sampled_from(["false", 0, None]))


@pytest.fixture(scope="module")
def chat(apertus_tokenizer_dir) -> ChatTokenizer:
    return ChatTokenizer(apertus_tokenizer_dir)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(messages=st.one_of(messages_st, json_like), tools=tools_st, thinking=flags, generation=flags)
def test_any_conversation_renders_and_tokenizes_or_is_a_chat_format_error(chat, messages, tools, thinking, generation):
    size = len(repr(messages)) + len(repr(tools))
    start = time.perf_counter()
    try:
        text = render(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=generation)
    except ChatFormatError:
        text = None
    try:
        enc = chat.encode_conversation(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=generation)
    except ChatFormatError as exc:
        assert "\ue000" not in str(exc) or "\ue000" in repr(messages) + repr(tools)  # no mark of its own
    else:
        assert text is not None and enc.text == text  # the same rule decides both
        assert len(enc.ids) == len(enc.roles)
        user = enc.ids[enc.roles == 3]
        assert not set(user.tolist()) & chat.spec.structure_ids
    _within(5.0 + size * 1e-4, start)
