"""The report's padded audio batching against the transformers port's own batched encoding.

The port batches clips of different lengths its own way: ``WavTokenizerFeatureExtractor`` pads them
to the longest (with the Apertus peak normalization, ``normalize_audio=True``) and returns a
``padding_mask``; ``WavTokenizerEncoderModel.encode`` encodes the padded batch and marks each clip's
``ceil(n / 600)`` valid codes in ``audio_codes_mask``. ``encoders.encode_audio_padded`` must give,
for the same clips, exactly the port's valid codes with the report's drop applied: all of them for
the longest clip, all but the last five for a padded one (report 2.3.2). The codes of the longest
clip also equal its single-clip encoding (it has no padding after it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _encoder_oracles import port_audio
from transformers.models.wavtokenizer.feature_extraction_wavtokenizer import WavTokenizerFeatureExtractor

from apertus_plugins.core.media import audio
from apertus_plugins.encoders import AudioTokenizer, encode_audio, encode_audio_padded
from apertus_plugins.testing.random_weights import random_audio_tokenizer

#: One batch of mixed lengths (24 kHz samples): two equal longest, short ones, one of at most five codes.
BATCH = [24_000, 5_003, 17_999, 24_000, 1_800, 12_601, 600 * 9 + 1]


@pytest.fixture(scope="module")
def audio_tok() -> AudioTokenizer:
    return random_audio_tokenizer(seed=12)


def _raw(n: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(n) / audio.SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * rng.uniform(100, 3000) * t) + 0.2 * rng.standard_normal(n)).astype(np.float32)


def test_padded_batch_equals_the_ports_batched_encoding(audio_tok: AudioTokenizer) -> None:
    rng = np.random.default_rng(38)
    raw = [_raw(n, rng) for n in BATCH]
    clips = [audio.preprocess_audio(x, audio.SAMPLE_RATE) for x in raw]
    fe = WavTokenizerFeatureExtractor(normalize_audio=True)
    feats = fe(raw, sampling_rate=audio.SAMPLE_RATE, return_tensors="pt")
    wave, mask = feats["input_values"], feats["padding_mask"]
    assert wave.shape[-1] == max(BATCH)
    padded_ours = np.zeros((len(clips), max(BATCH)), np.float32)
    for row, c in zip(padded_ours, clips, strict=True):
        row[: c.size] = c
    assert np.array_equal(wave.reshape(len(clips), -1).numpy(), padded_ours)  # same preprocessing and padding
    port = port_audio(audio_tok)
    with torch.inference_mode():
        out = port.encode(wave.reshape(len(clips), 1, -1), padding_mask=mask)
    codes, valid = out.audio_codes[:, 0].numpy(), out.audio_codes_mask[:, 0].numpy().astype(bool)
    got = encode_audio_padded(audio_tok, clips)
    single = encode_audio(audio_tok, clips, batch_size=1)
    keep = audio.padded_code_counts(BATCH)
    equal_kept = total_kept = dropped_differ = 0
    for j, n in enumerate(BATCH):
        port_valid = codes[j][valid[j]]
        assert port_valid.size == audio.audio_code_count(n)
        assert got[j].tolist() == port_valid[: keep[j]].tolist(), f"clip {j} of {n} samples"
        if n == max(BATCH):
            assert got[j].tolist() == single[j].tolist()  # the longest: not padded, nothing dropped
        else:
            total_kept += keep[j]
            equal_kept += int((got[j] == single[j][: keep[j]]).sum())
            dropped_differ += int((port_valid[keep[j]:] != single[j][keep[j]:]).sum())
    assert keep[BATCH.index(1_800)] == 0  # three codes, all dropped once padded
    print(f"\npadded clips: {equal_kept}/{total_kept} kept codes equal single-clip encoding; "
          f"{dropped_differ}/{5 * (len(BATCH) - 2)} dropped codes differ from it")
