"""Media sequences: sizes and grids, the two image layouts, audio preprocessing and training modes."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from apertus_plugins.core.media import audio, image
from apertus_plugins.core.vocab import VocabSpec

SPECS = [VocabSpec(), VocabSpec.scaled()]


@settings(max_examples=2000, deadline=None)
@given(h=st.integers(1, 5000), w=st.integers(1, 5000))
def test_resized_size_rules(h, w):
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(image.ImageError, match=f"{h}x{w}.*aspect ratio"):
            image.resized_size(h, w)
        return
    rh, rw = image.resized_size(h, w)
    assert rh % 16 == 0 and rw % 16 == 0 and rh >= 16 and rw >= 16
    assert rh * rw <= 1400 * 1400
    if rh * rw < 128 * 128:  # only the max(16, ...) floor of an extreme aspect can leave the budget
        assert min(rh, rw) == 16
    # aspect ratio kept up to the rounding to multiples of 16
    assert abs(math.log((rh / rw) / (h / w))) < math.log(1 + 16 / min(rh, rw)) * 2 + 1e-9
    assert image.image_grid(h, w) == (rh // 16, rw // 16)


def test_resized_size_examples():
    assert image.resized_size(48, 64) == (112, 160)      # upscaled to the minimum budget, ceil
    assert image.resized_size(1000, 1000) == (992, 992)  # nearest multiple, round-half-even as released
    assert image.resized_size(3000, 2000) == (1712, 1136)  # above the budget: scale and floor
    with pytest.raises(ValueError, match="unknown resize policy"):
        image.resized_size(10, 10, "nope")


@pytest.mark.parametrize("spec", SPECS, ids=["full", "scaled"])
def test_both_layouts(spec):
    codes = np.arange(6).reshape(2, 3)
    char = {c: [100 + i] for i, c in enumerate("0123456789*")}

    def text_ids(s):
        return [i for ch in s for i in char[ch]]

    inf = list(image.image_sequence(codes, spec, "inference", text_ids=text_ids))
    tr = list(image.image_sequence(codes, spec, "training", text_ids=text_ids))
    off = spec.modality("image").offset
    head = [spec.id("img_start"), 102, 110, 103, spec.id("img_token_start")]
    eor = spec.id("img_end_of_row")
    assert inf == head + [off, off + 1, off + 2, eor, off + 3, off + 4, off + 5, spec.id("img_end")]
    assert tr == head + [off, off + 1, off + 2, eor, off + 3, off + 4, off + 5, eor,
                         spec.id("img_end_of_frame"), spec.id("img_end")]
    assert image.detect_image_layout(inf, spec) == "inference"
    assert image.detect_image_layout(tr + [5] + tr, spec) == "training"
    assert image.detect_image_layout([1, 2, 3], spec) is None
    with pytest.raises(ValueError, match="mixes image layouts"):
        image.detect_image_layout(inf + tr, spec)
    ph = list(image.image_placeholder_sequence(2, 3, spec, "inference", text_ids=text_ids))
    assert len(ph) == len(inf) and ph.count(spec.id("image")) == 6
    with pytest.raises(ValueError, match="unknown image layout"):
        image.image_sequence(codes, spec, "diagonal", text_ids=text_ids)
    with pytest.raises(ValueError, match="needs text_ids"):
        image.image_sequence(codes, spec)



def test_dataset_image_layouts_scans_documents_with_images():
    spec = SPECS[1]
    codes = np.arange(4).reshape(2, 2)

    def text_ids(s):
        return [100 + "0123456789*".index(ch) for ch in s]

    inf = list(image.image_sequence(codes, spec, "inference", text_ids=text_ids))
    tr = list(image.image_sequence(codes, spec, "training", text_ids=text_ids))

    class Docs:
        def __init__(self, *docs):
            self.docs = [np.asarray(d) for d in docs]
            self.num_documents = len(self.docs)

        def document(self, i):
            return self.docs[i]

    assert image.dataset_image_layouts(Docs([1, 2], [3]), spec) == set()
    assert image.dataset_image_layouts(Docs([1, 2], inf, [7] + inf), spec) == {"inference"}
    assert image.dataset_image_layouts(Docs(inf, tr), spec) == {"inference", "training"}
    assert image.dataset_image_layouts(Docs(inf + tr, inf), spec) == {"mixed", "inference"}
    # only the first `limit` documents holding an image count; documents without one do not
    assert image.dataset_image_layouts(Docs([5], inf, [6], tr), spec, limit=1) == {"inference"}
    assert image.dataset_image_layouts(Docs([5], inf, [6], tr), spec, limit=None) == {"inference", "training"}

def test_preprocess_image_values_and_modes(tmp_path):
    rng = np.random.default_rng(0)
    for mode in ("RGB", "RGBA", "L", "P"):
        arr = rng.integers(0, 256, (40, 90, 3), dtype=np.uint8)
        img = Image.fromarray(arr, "RGB").convert(mode)
        out = image.preprocess_image(img)
        assert out.pixels.shape == (3, out.height, out.width) and out.pixels.dtype == np.float32
        assert out.grid == (out.height // 16, out.width // 16)
        assert out.pixels.min() >= -1.0 and out.pixels.max() <= 1.0
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    with pytest.raises(image.ImageError, match="bad.jpg: not a readable image"):
        image.preprocess_image(bad)


def _wav_bytes(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_audio_preprocessing():
    rate = 16_000
    t = np.arange(rate) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 300 * t), 0.1 * np.sin(2 * np.pi * 300 * t)]).astype(np.float32)
    wave, r = audio.load_audio(_wav_bytes(stereo.T, rate))
    assert r == rate and wave.shape == (2, rate)
    y = audio.preprocess_audio(wave, r)
    assert y.dtype == np.float32 and y.shape == (24_000,)  # 1 s at 24 kHz
    assert abs(20 * np.log10(np.abs(y).max()) - (-3.0)) < 1e-5
    y2 = audio.preprocess_audio(np.full(10, 0.25, np.float32), 24_000)
    np.testing.assert_array_equal(y2, np.float32(0.25) * np.float32(10 ** (-3 / 20) / 0.25))
    assert audio.audio_code_count(0) == 0 and audio.audio_code_count(1) == 1
    assert audio.audio_code_count(600) == 1 and audio.audio_code_count(601) == 2
    assert audio.audio_code_count(24_000 * 60) == 2400


def test_audio_file_errors(tmp_path):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(audio.AudioError, match="empty.wav: the file is empty"):
        audio.load_audio(empty)
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    with pytest.raises(audio.AudioError, match="notes.wav"):
        audio.load_audio(text)
    silent = tmp_path / "zero.wav"
    sf.write(silent, np.zeros((0, 1), np.float32), 24_000)
    with pytest.raises(audio.AudioError, match="zero.wav"):
        audio.load_audio(silent)
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        audio.load_audio(tmp_path / "missing.wav")


@pytest.mark.parametrize("spec", SPECS, ids=["full", "scaled"])
def test_audio_layout_and_modes(spec):
    off = spec.modality("audio").offset
    assert list(audio.audio_sequence([0, 5], spec)) == [spec.id("audio_start"), off, off + 5, spec.id("audio_end")]
    assert list(audio.audio_placeholder_sequence(2, spec)) == [spec.id("audio_start"), spec.id("audio"),
                                                               spec.id("audio"), spec.id("audio_end")]
    seq = list(audio.transcription_sequence([1], [7, 8], spec, "translate"))
    assert seq == [spec.id("audio_start"), off + 1, spec.id("audio_end"), spec.id("stt_translate"), 7, 8]
    with pytest.raises(ValueError, match="unknown audio task"):
        audio.transcription_sequence([1], [7], spec, "sing")


def _reference_interleave(clips, spec):
    """From the rule text: per copy (start 0, start 1) alternate audio/text, end on text; leftovers transcribed."""
    inter, left = [], []
    for start in (0, 1):
        copy = clips[start:]
        seq, k = [], 0
        while k + 1 < len(copy):
            a, _ = copy[k]
            _, t = copy[k + 1]
            seq += [spec.id("audio_start")] + [spec.modality("audio").offset + c for c in a] + [spec.id("audio_end")]
            seq += [spec.id("stt_continue")] + list(t)
            k += 2
            if k + 1 < len(copy):
                seq += [spec.id("tts_continue")]
        if seq:
            inter.append(seq)
        for a, t in copy[k:]:
            left.append([spec.id("audio_start")] + [spec.modality("audio").offset + c for c in a]
                        + [spec.id("audio_end"), spec.id("stt_transcribe")] + list(t))
    return inter + left


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_interleaved_builder(n):
    spec = VocabSpec.scaled()
    clips = [([k, k + 1], [300 + k]) for k in range(n)]
    got = [list(s) for s in audio.interleaved_sequences(clips, spec)]
    assert got == _reference_interleave(clips, spec)
    text = {300 + k for k in range(n)}
    for s in got:
        assert s[-1] in text  # every sequence ends with text
    if n >= 2:  # clip 1 is text in the first copy and audio in the second
        assert 301 in got[0] and spec.modality("audio").offset + 2 in got[1][:4]
