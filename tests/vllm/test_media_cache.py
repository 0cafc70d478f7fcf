"""The model's encoder call through the persistent media-code cache, without a server.

The served model (``Apertus1p5ForConditionalGeneration``) is built bare around the checkpoint's
encoders (what vLLM's loader fills in is the same ``VisionTokenizer`` / ``AudioTokenizer``), and its
own ``_encode`` runs: the first call encodes, the second encodes nothing and returns the same codes,
and ``apertus encode``'s path finds the entries the model stored (one cache for serving and the tools).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from apertus_plugins.encoders import encode_audio, encode_images, load_audio_tokenizer, load_vision_tokenizer
from apertus_plugins.encoders.cache import MediaCodeCache


@pytest.fixture(scope="module")
def model_class():
    import vllm_model

    vllm_model.register()
    from vllm_model.model import Apertus1p5ForConditionalGeneration

    return Apertus1p5ForConditionalGeneration


def _bare(cls, checkpoint, cache):
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.vision_tokenizer, m.audio_tokenizer = load_vision_tokenizer(checkpoint), load_audio_tokenizer(checkpoint)
    m.media_cache, m._cache_logged = cache, 0
    return m


def _counting(module: nn.Module) -> list[int]:
    calls: list[int] = []
    encode = module.encode

    def counted(x):
        calls.append(len(x))
        return encode(x)

    module.encode = counted  # type: ignore[method-assign]
    return calls


def test_served_encoder_calls_go_through_the_cache(model_class, checkpoint, tmp_path, caplog, monkeypatch):
    g = torch.Generator().manual_seed(5)
    images = [torch.rand(3, 32, 48, generator=g) * 2 - 1, torch.rand(3, 32, 48, generator=g) * 2 - 1,
              torch.rand(3, 16, 16, generator=g) * 2 - 1]
    images.append(images[0].clone())
    clips = [torch.randn(1800, generator=g) * 0.1, torch.randn(2400, generator=g) * 0.1]
    plain = _bare(model_class, checkpoint, None)
    want_img, want_aud = plain._encode("image", images), plain._encode("audio", clips)

    monkeypatch.setattr("vllm_model.model.CACHE_LOG_EVERY", 1)
    model = _bare(model_class, checkpoint, MediaCodeCache(tmp_path / "codes"))
    vcalls, acalls = _counting(model.vision_tokenizer), _counting(model.audio_tokenizer)
    from vllm_model.logs import LOGGER

    shown = logging.getLogger(f"{LOGGER}.model")  # under vLLM's logger, which does not propagate: listen there
    shown.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=shown.name):
            for _ in range(2):
                got_img, got_aud = model._encode("image", images), model._encode("audio", clips)
                for got, want in zip(got_img + got_aud, want_img + want_aud, strict=True):
                    assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)
    finally:
        shown.removeHandler(caplog.handler)
    assert vcalls == [2, 1] and acalls == [1, 1]  # the first round only, by shape; the repeated image once
    assert model.media_cache.hits == 1 + 6 and model.media_cache.misses == 5  # the repeat, then the second round
    assert "hits" in caplog.text and "misses" in caplog.text

    # `apertus encode` / `apertus tokenize` read what the server stored: numpy pixels, the same key
    tool = MediaCodeCache(tmp_path / "codes")
    grids = encode_images(load_vision_tokenizer(checkpoint), [x.numpy() for x in images], cache=tool)
    codes = encode_audio(load_audio_tokenizer(checkpoint), [x.numpy() for x in clips], cache=tool)
    assert tool.misses == 0 and tool.hits == 6
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(grids + codes, want_img + want_aud, strict=True))
