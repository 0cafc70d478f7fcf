"""The Emu3.5 IBQ vision tokenizer, encode only (SPEC.md 2.1 and 5).

A VQGAN-style convolutional encoder (five stages of residual blocks, stride-2 downsampling after
the first four, single-head attention in the last stage and in the middle block) followed by a
1x1 ``quant_conv`` and a codebook of 131,072 vectors of dimension 256. An image of H x W pixels
(multiples of 16) becomes an (H/16) x (W/16) grid of codebook indices; index = argmax over the
codebook of the dot product between the quantizer input and each codebook vector.

The parameter names are those of the released ``transformers`` port under
``model.vision_tokenizer.``, so the released tensors load with ``load_state_dict`` as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionTokenizerConfig
from .precision import Precision, PrecisionError, check_float32, check_precision, precision_scope
from .threads import encode_threads

__all__ = ["VisionTokenizerConfig", "VisionTokenizer", "select_codes_by_dot_product", "SCORE_BUDGET_BYTES"]

#: Default bound on the score matrix of one code-selection chunk (positions x codebook slice).
SCORE_BUDGET_BYTES = 128 * 2**20
#: Score block of one code-selection step on CPU (fits the last-level cache of one core's share).
CPU_BLOCK_BYTES = 2 * 2**20
_GROUPS = 32  # GroupNorm groups
_EPS = 1e-6


# ---------------------------------------------------------------------- building blocks
def _swish(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in place (the port's arithmetic; not F.silu, whose rounding differs)."""
    return x.mul_(torch.sigmoid(x))


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(_GROUPS, channels, eps=_EPS, affine=True)


class _ResBlock(nn.Module):
    """GroupNorm - swish - conv3x3 - GroupNorm - swish - conv3x3, plus a 1x1 shortcut when widths differ."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.norm1 = _norm(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(_swish(self.norm1(x)))
        h = self.conv2(_swish(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return h.add_(skip)  # float addition commutes: the same bits as skip + h


class _Attention(nn.Module):
    """Single-head global self-attention with 1x1 q/k/v/proj convolutions, scale c^-1/2."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, rows, cols = x.shape
        n = rows * cols
        q = self.q(h).reshape(b, c, n).transpose(1, 2)  # [b, n, c]
        k = self.k(h).reshape(b, c, n)  # [b, c, n]
        v = self.v(h).reshape(b, c, n)
        del h
        weights = torch.bmm(q, k).mul_(c ** (-0.5))  # [b, n (query), n (key)]
        weights = torch.softmax(weights, dim=2)
        out = torch.bmm(v, weights.transpose(1, 2)).reshape(b, c, rows, cols)
        return self.proj_out(out).add_(x)


class _Downsample(nn.Module):
    """Pad right and bottom by one, then a stride-2 3x3 convolution without padding."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _Layer(nn.Module):
    def __init__(self, c_in: int, c_out: int, attention: bool) -> None:
        super().__init__()
        self.resnet = _ResBlock(c_in, c_out)
        self.attention = _Attention(c_out) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnet(x)
        return x if self.attention is None else self.attention(x)


class _Stage(nn.Module):
    def __init__(self, cfg: VisionTokenizerConfig, index: int) -> None:
        super().__init__()
        widths = cfg.stage_widths
        c_in = cfg.base_channels if index == 0 else widths[index - 1]
        attention = cfg.stage_has_attention(index)
        self.layers = nn.ModuleList(
            _Layer(c_in if j == 0 else widths[index], widths[index], attention) for j in range(cfg.num_res_blocks))
        self.downsample = _Downsample(widths[index]) if index < len(widths) - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.downsample is None else self.downsample(x)


class _Mid(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block_1 = _ResBlock(channels, channels)
        self.attn_1 = _Attention(channels)
        self.block_2 = _ResBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        top = cfg.stage_widths[-1]
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.base_channels, 3, padding=1)
        self.stages = nn.ModuleList(_Stage(cfg, s) for s in range(len(cfg.channel_multiplier)))
        self.mid = _Mid(top)
        self.norm_out = _norm(top)
        self.conv_out = nn.Conv2d(top, cfg.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for stage in self.stages:
            x = stage(x)
        x = self.mid(x)
        return self.conv_out(_swish(self.norm_out(x)))


class _Codebook(nn.Module):
    """Holds ``embedding.weight`` [codebook_size, embed_dim] (the port keeps it in a bias-free Linear)."""

    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        self.embedding = nn.Linear(cfg.embed_dim, cfg.codebook_size, bias=False)


def select_codes_by_dot_product(latents: torch.Tensor, codebook: torch.Tensor,
                                budget_bytes: int = SCORE_BUDGET_BYTES) -> torch.Tensor:
    """argmax over the codebook of ``<latent, codebook[i]>`` for every position, in bounded memory.

    Args:
        latents: ``[B, D, h, w]``, the quantizer input (after ``quant_conv``).
        codebook: ``[N, D]``.
        budget_bytes: the largest score block computed at once. On a GPU, when all ``B*h*w x N``
            scores fit, this is one matrix product (the port's arithmetic); otherwise, and always on
            CPU, the scores are computed block by block (on CPU blocks of at most
            :data:`CPU_BLOCK_BYTES`, which stay in the cache: 1.5-1.7x faster than one product whose
            scores go through memory) and a running maximum keeps the first index of the largest
            score, as ``argmax`` does. Every score is a dot product over the same ``D`` terms either
            way; the codes are the port's (``tests/reference``).

    Returns:
        LongTensor ``[B, h, w]``.
    """
    b, d, rows, cols = latents.shape
    n = codebook.shape[0]
    # the port's flatten + transpose + Linear folds to this [positions, D] matrix (a view when B == 1)
    x = latents.flatten(2).transpose(1, 2).reshape(-1, d)
    m = x.shape[0]
    if x.device.type == "cpu":
        return _select_in_blocks(x, codebook, min(budget_bytes, CPU_BLOCK_BYTES)).view(b, rows, cols)
    if m * n * 4 <= budget_bytes:
        return torch.mm(x, codebook.t()).argmax(dim=1).view(b, rows, cols)
    return _select_in_blocks(x, codebook, budget_bytes).view(b, rows, cols)


def _select_in_blocks(x: torch.Tensor, codebook: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """Blocks of ``codebook rows x positions`` scores (the codebook slices multiples of 256 rows)."""
    m, n = x.shape[0], codebook.shape[0]
    code_step = min(n, max(256, (block_bytes // (4 * min(m, 256))) // 256 * 256))
    pos_step = max(1, min(m, block_bytes // (4 * code_step)))
    out = torch.empty(m, dtype=torch.long, device=x.device)
    buffer = torch.empty(code_step * pos_step, dtype=x.dtype, device=x.device)  # reused: no page faults
    for p0 in range(0, m, pos_step):
        xt = x[p0 : p0 + pos_step].t()
        k = xt.shape[1]
        best_val = torch.full((k,), -math.inf, dtype=x.dtype, device=x.device)
        best_idx = torch.zeros(k, dtype=torch.long, device=x.device)
        for s in range(0, n, code_step):
            rows = codebook[s : s + code_step]
            scores = torch.mm(rows, xt, out=buffer[: rows.shape[0] * k].view(rows.shape[0], k))
            val, idx = scores.max(dim=0)  # the first index of the largest score within the block
            better = val > best_val  # strict: an equal score later in the codebook keeps the first index
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + s, best_idx)
        out[p0 : p0 + k] = best_idx
    return out


def _as_batch(pixels: Any, what: str) -> torch.Tensor:
    if isinstance(pixels, (list, tuple)):
        arrs = [torch.as_tensor(p) for p in pixels]
        shapes = sorted({tuple(a.shape) for a in arrs})
        if len(shapes) > 1:
            raise ValueError(f"{what}: items of different shapes {shapes} cannot share a batch (padding changes "
                             "codes); group them by exact shape (encoders.group_by_shape, encoders.encode_images)")
        if not arrs:
            raise ValueError(f"{what}: no items")
        return torch.stack(arrs)
    return torch.as_tensor(pixels)


class VisionTokenizer(nn.Module):
    """The IBQ vision tokenizer: pixels in [-1, 1] -> a grid of codebook indices per image.

    Args:
        config: sizes (default: the released tokenizer).
        precision: ``"float32"`` (default, exact) or ``"tf32"`` (CUDA only); see
            :mod:`apertus_plugins.encoders.precision`. Applied by :meth:`encode` itself.

    Batching: items of one call share a batch tensor, so they must have identical shapes; never
    pad images to a common size (the encoder is not padding-invariant). Group items with
    :func:`apertus_plugins.encoders.group_by_shape`, or call
    :func:`apertus_plugins.encoders.encode_images`, which does it.
    """

    def __init__(self, config: VisionTokenizerConfig | None = None, precision: Precision = "float32") -> None:
        super().__init__()
        self.config = config or VisionTokenizerConfig()
        self.precision: str = check_precision(precision)
        #: Bound on one code-selection score block, in bytes (see :func:`select_codes_by_dot_product`).
        self.score_budget_bytes: int = SCORE_BUDGET_BYTES
        self.encoder = _Encoder(self.config)
        self.quant_conv = nn.Conv2d(self.config.latent_channels, self.config.embed_dim, 1)
        self.quantize = _Codebook(self.config)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.quant_conv.weight.device

    def check_ready(self) -> None:
        """Raise :class:`~apertus_plugins.encoders.precision.PrecisionError` on half weights or TF32 on CPU."""
        check_precision(self.precision, self.device)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            check_float32(t, f"vision tokenizer weight {name!r}")

    def latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """The quantizer input ``[B, embed_dim, H/16, W/16]`` (no checks, no precision scope).

        Channels-first, as the port computes it: channels-last activations would run the
        convolutions 1.2-1.3x faster on CPU but round differently and flip about one code in 5,000
        (measured on the tiny configuration against the port), so they are not used.
        """
        return self.quant_conv(self.encoder(pixels))

    def encode(self, pixels: torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Codebook indices of a batch of same-shape images.

        Args:
            pixels: float32 ``[B, 3, H, W]`` (or one ``[3, H, W]``) in [-1, 1], H and W multiples of
                16, as :func:`apertus_plugins.core.media.image.preprocess_image` returns them; a list of
                same-shape items is stacked. Items of different shapes raise ``ValueError``.

        Returns:
            LongTensor ``[B, H/16, W/16]`` of indices in ``[0, codebook_size)`` (no vocabulary
            offset), on the tokenizer's device.

        Raises:
            ValueError: wrong shape, ragged items, values outside [-1, 1]. PrecisionError: half
            precision input or weights, TF32 on CPU.
        """
        x = _as_batch(pixels, "VisionTokenizer.encode")
        if x.dim() == 3:
            x = x.unsqueeze(0)
        f = self.config.spatial_scale_factor
        if x.dim() != 4 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"VisionTokenizer.encode: expected pixels [B, {self.config.in_channels}, H, W], "
                             f"got shape {list(x.shape)}")
        if x.shape[0] == 0 or x.shape[2] <= 0 or x.shape[3] <= 0 or x.shape[2] % f or x.shape[3] % f:
            raise ValueError(f"VisionTokenizer.encode: height and width must be positive multiples of {f}, got "
                             f"{x.shape[2]}x{x.shape[3]} (preprocess with apertus_plugins.core.media.image.preprocess_image)")
        if not x.is_floating_point():
            raise ValueError(f"VisionTokenizer.encode: pixels must be float32 in [-1, 1], got {x.dtype}")
        if x.dtype != torch.float32:
            check_float32(x, "VisionTokenizer.encode: the pixels")  # refuses half, names other dtypes
        self.check_ready()
        x = x.to(self.device)
        lo, hi = float(x.min()), float(x.max())
        if not (-1.001 <= lo and hi <= 1.001):
            raise ValueError(f"VisionTokenizer.encode: pixels must lie in [-1, 1], got [{lo:g}, {hi:g}] "
                             "(preprocess with apertus_plugins.core.media.image.preprocess_image)")
        with torch.inference_mode(), precision_scope(self.precision), encode_threads(self.device):
            z = self.latents(x)
            if not bool(torch.isfinite(z).all()):
                raise PrecisionError("VisionTokenizer.encode: the encoder produced non-finite values (broken weights?)")
            return select_codes_by_dot_product(z, self.quantize.embedding.weight, self.score_budget_bytes)
