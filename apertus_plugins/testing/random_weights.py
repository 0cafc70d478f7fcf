"""Random encoder weights with a realistic spread, for test checkpoints, demos and benchmarks.

Plain initializations leave the codebooks degenerate (the port's audio codebook starts at zero,
so every frame ties; a random vision codebook far from the encoder's output picks a handful of
codes). :func:`init_random_weights` draws fan-in scaled convolutions, perturbed norms, and then
calibrates the codebook on the encoder's own outputs for random inputs (codebook vectors are
output vectors plus noise), so codes vary across positions as with trained weights. Deterministic
for a seed, on CPU: it runs on one thread, because multi-threaded CPU convolutions and
reductions may sum in another order (and round differently) when the thread count differs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from apertus_plugins.encoders.audio import AudioTokenizer
from apertus_plugins.encoders.config import AudioTokenizerConfig, VisionTokenizerConfig
from apertus_plugins.encoders.vision import VisionTokenizer

__all__ = ["init_random_weights", "random_audio_tokenizer", "random_vision_tokenizer"]


def _conv_init_(weight: torch.Tensor, gen: torch.Generator, gain: float = 1.0) -> None:
    fan_in = weight[0].numel()
    weight.copy_(torch.randn(weight.shape, generator=gen) * (gain / math.sqrt(fan_in)))


@torch.no_grad()
def init_random_weights(tokenizer: VisionTokenizer | AudioTokenizer, seed: int = 0) -> None:
    """Fill ``tokenizer`` (in place, on CPU, float32) with seeded random weights and a calibrated codebook."""
    gen = torch.Generator().manual_seed(int(seed))
    if isinstance(tokenizer, VisionTokenizer):
        with _one_thread():
            _init_vision(tokenizer, gen)
    elif isinstance(tokenizer, AudioTokenizer):
        with _one_thread():
            _init_audio(tokenizer, gen)
    else:
        raise TypeError(f"expected a VisionTokenizer or an AudioTokenizer, got {type(tokenizer).__name__}")


def random_vision_tokenizer(seed: int = 0, config: VisionTokenizerConfig | None = None) -> VisionTokenizer:
    """A vision tokenizer of ``config`` (default: :meth:`VisionTokenizerConfig.tiny`) with
    :func:`init_random_weights` of ``seed``."""
    tok = VisionTokenizer(config or VisionTokenizerConfig.tiny())
    init_random_weights(tok, seed=seed)
    return tok


def random_audio_tokenizer(seed: int = 0, config: AudioTokenizerConfig | None = None) -> AudioTokenizer:
    """An audio tokenizer of ``config`` (default: :meth:`AudioTokenizerConfig.tiny`) with
    :func:`init_random_weights` of ``seed``."""
    tok = AudioTokenizer(config or AudioTokenizerConfig.tiny())
    init_random_weights(tok, seed=seed)
    return tok


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _init_vision(tok: VisionTokenizer, gen: torch.Generator) -> None:
    for module in tok.modules():
        if isinstance(module, nn.Conv2d):
            _conv_init_(module.weight, gen, gain=1.0)
            module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.02)
        elif isinstance(module, nn.GroupNorm):
            module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
            module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    cfg = tok.config
    # calibrate: latents of a few random smooth images, sampled with replacement, plus noise
    f = cfg.spatial_scale_factor
    coarse = torch.rand((3, 3, 4, 4), generator=gen) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(6 * f, 6 * f), mode="bilinear", align_corners=False)
    images = (images + 0.2 * torch.randn(images.shape, generator=gen)).clamp_(-1, 1)
    latents = tok.latents(images).permute(0, 2, 3, 1).reshape(-1, cfg.embed_dim)
    pick = torch.randint(0, latents.shape[0], (cfg.codebook_size,), generator=gen)
    spread = latents.std(dim=0, keepdim=True)
    tok.quantize.embedding.weight.copy_(latents[pick] + 0.5 * spread * torch.randn(
        (cfg.codebook_size, cfg.embed_dim), generator=gen))


def _init_audio(tok: AudioTokenizer, gen: torch.Generator) -> None:
    for module in tok.modules():
        if isinstance(module, nn.Conv1d):
            params = module.parametrizations.weight
            v = torch.empty_like(params.original1)
            _conv_init_(v, gen, gain=1.0)
            params.original1.copy_(v)
            params.original0.copy_(v.flatten(1).norm(dim=1).view_as(params.original0))
            module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.02)
        elif isinstance(module, nn.LSTM):
            bound = 1.0 / math.sqrt(module.hidden_size)
            for p in module.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    cfg = tok.config
    t = torch.arange(cfg.sampling_rate // 4, dtype=torch.float32) / cfg.sampling_rate
    freqs = 80 + 2000 * torch.rand((3, 1), generator=gen)
    wave = 0.4 * torch.sin(2 * math.pi * freqs * t * (1 + t)) + 0.1 * torch.randn((3, t.numel()), generator=gen)
    latents = tok.latents(wave[:, None]).transpose(1, 2).reshape(-1, cfg.hidden_size)
    pick = torch.randint(0, latents.shape[0], (cfg.codebook_size,), generator=gen)
    spread = latents.std(dim=0, keepdim=True)
    embed = latents[pick] + 0.5 * spread * torch.randn((cfg.codebook_size, cfg.hidden_size), generator=gen)
    book = tok.quantizer.codebook
    book.embed.copy_(embed)
    book.embed_avg.copy_(embed)
    book.cluster_size.copy_(torch.ones(cfg.codebook_size))
    book.inited.fill_(1.0)
