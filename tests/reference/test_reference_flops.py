"""The FLOP counter (used by the GPU benchmark's floor) against torch's own counter and a hand count."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize
from torch.utils.flop_counter import FlopCounterMode

from apertus_plugins.encoders import (
    AudioTokenizer,
    AudioTokenizerConfig,
    VisionTokenizer,
    VisionTokenizerConfig,
    audio_flops,
    select_codes_by_distance,
    select_codes_by_dot_product,
    vision_flops,
)


@pytest.mark.parametrize("cfg,h,w,b", [(VisionTokenizerConfig.tiny(), 128, 192, 2),
                                       (VisionTokenizerConfig(base_channels=64, num_res_blocks=2, codebook_size=1024),
                                        64, 96, 1)])
def test_vision_flops_equal_torchs_count(cfg, h, w, b):
    tok = VisionTokenizer(cfg)
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        select_codes_by_dot_product(tok.latents(torch.zeros(b, 3, h, w)), tok.quantize.embedding.weight)
    assert vision_flops(cfg, h, w, batch=b).total == fc.get_total_flops()


@pytest.mark.parametrize("cfg,t", [(AudioTokenizerConfig.tiny(), 24_001), (AudioTokenizerConfig(), 6000),
                                   (AudioTokenizerConfig.tiny(), 5)])
def test_audio_flops_equal_torchs_count_plus_the_lstm(cfg, t):
    tok = AudioTokenizer(cfg)
    with torch.inference_mode(), parametrize.cached():
        for m in tok.modules():  # weight norm outside the counter (it is not a product)
            if isinstance(m, torch.nn.Conv1d):
                _ = m.weight
        with FlopCounterMode(display=False) as fc:
            select_codes_by_distance(tok.latents(torch.zeros(3, 1, t)), tok.quantizer.codebook.embed)
    count = audio_flops(cfg, t, batch=3)
    assert count.conv + count.codebook == fc.get_total_flops()  # torch does not count the LSTM kernel
    frames = -(-t // cfg.hop_length)
    width = cfg.num_filters * 2 ** len(cfg.upsampling_ratios)
    # by hand: per layer and frame, 4 gates x (input + hidden) x hidden multiply-adds
    assert count.matmul == 3 * cfg.num_lstm_layers * frames * 4 * (width + width) * width * 2


def test_hand_count_of_the_released_vision_encoder_at_512():
    c = vision_flops(VisionTokenizerConfig(), 512, 512)
    assert c.parts["conv_in"] == 2 * 3 * 256 * 9 * 512 * 512
    # stage 0: four residual blocks of two 3x3 convolutions 256 -> 256 at full resolution
    assert c.parts["stage0.resnet"] == 4 * 2 * (2 * 256 * 256 * 9 * 512 * 512)
    assert c.parts["codebook"] == 2 * 32 * 32 * 131_072 * 256
    # last stage: 1024 channels at 32x32 = 1024 positions, attention products 2 x (2 n^2 c) per block
    assert c.parts["stage4.attention"] == 4 * (4 * 2 * 1024 * 1024 * 1024 + 2 * 2 * 1024**2 * 1024)
    assert 3.5e12 < c.total < 4.5e12
