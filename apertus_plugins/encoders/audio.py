"""The WavTokenizer audio tokenizer, encode only (SPEC.md 2.2 and 5).

A SEANet encoder (weight-normalized 1-D convolutions with reflect padding that pads on the right
to a whole number of frames, one residual block per stage, strides 4, 5, 5, 6 for a hop of 600, a
two-layer LSTM with a skip connection, a final convolution to 512 channels) and a Euclidean
codebook of 4,096 vectors. A 24 kHz clip of T samples becomes ceil(T / 600) codes; code = the
nearest codebook vector.

Parameter names are those of the released ``transformers`` port under ``model.audio_tokenizer.``
(weight norm as torch parametrizations: ``conv.parametrizations.weight.original0`` is the
magnitude g, ``original1`` the direction v).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .config import AudioTokenizerConfig
from .precision import Precision, PrecisionError, check_float32, check_precision, precision_scope
from .threads import encode_threads

__all__ = ["AudioTokenizerConfig", "AudioTokenizer", "select_codes_by_distance"]


# ---------------------------------------------------------------------- building blocks
class _Conv(nn.Module):
    """A weight-normalized Conv1d that pads so the output covers a whole number of frames.

    Padding total ``k_eff - stride``; non-causal: split with the extra half on the left
    (``left = total - total // 2``) plus, on the right, what completes the last frame. Reflect
    padding of inputs shorter than the pad first appends zeros (and drops them afterwards).
    """

    def __init__(self, cfg: AudioTokenizerConfig, c_in: int, c_out: int, kernel: int, stride: int = 1,
                 dilation: int = 1) -> None:
        super().__init__()
        self.conv = weight_norm(nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation))
        self.causal = cfg.use_causal_conv
        self.pad_mode = cfg.pad_mode
        self.stride = stride
        self.kernel_eff = (kernel - 1) * dilation + 1
        self.pad_total = self.kernel_eff - stride

    def extra_padding(self, length: int) -> int:
        """Right padding that makes the last frame complete (exact integer arithmetic).

        The port computes the frame count in float32 tensors; both agree for clips below 2**24
        samples (11.6 minutes at 24 kHz).
        """
        frames = -(-(length - self.kernel_eff + self.pad_total) // self.stride) + 1  # ceil(...) + 1
        ideal = (frames - 1) * self.stride + self.kernel_eff - self.pad_total
        return ideal - length

    def _pad(self, x: torch.Tensor, left: int, right: int) -> torch.Tensor:
        if self.pad_mode != "reflect":
            return F.pad(x, (left, right), self.pad_mode)
        length = x.shape[-1]
        widest = max(left, right)
        if length > widest:
            return F.pad(x, (left, right), "reflect")
        zeros = widest - length + 1  # reflect needs more input than the pad: extend with zeros, then drop them
        out = F.pad(F.pad(x, (0, zeros)), (left, right), "reflect")
        return out[..., : out.shape[-1] - zeros]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.extra_padding(x.shape[-1])
        if self.causal:
            x = self._pad(x, self.pad_total, extra)
        else:
            right = self.pad_total // 2
            x = self._pad(x, self.pad_total - right, right + extra)
        return self.conv(x)


class _ResBlock(nn.Module):
    """ELU - conv(k, dilation) to dim/compress - ELU - conv(1) back to dim, plus a 1x1 conv skip."""

    def __init__(self, cfg: AudioTokenizerConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        # indices 0..3 as in the checkpoint: ELU, conv, ELU, conv
        self.block = nn.ModuleList([nn.ELU(), _Conv(cfg, dim, hidden, cfg.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), _Conv(cfg, hidden, dim, 1)])
        self.shortcut = _Conv(cfg, dim, dim, 1) if cfg.use_conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        skip = x if self.shortcut is None else self.shortcut(x)
        return skip + h


class _LSTM(nn.Module):
    """A stacked LSTM over time with a skip connection, on [B, C, T] tensors."""

    def __init__(self, cfg: AudioTokenizerConfig, dim: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, cfg.num_lstm_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.permute(2, 0, 1)  # [T, B, C]
        return (self.lstm(t)[0] + t).permute(1, 2, 0)


class _Encoder(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig) -> None:
        super().__init__()
        width = cfg.num_filters
        layers: list[nn.Module] = [_Conv(cfg, cfg.audio_channels, width, cfg.kernel_size)]
        for ratio in reversed(cfg.upsampling_ratios):
            for j in range(cfg.num_residual_layers):
                layers.append(_ResBlock(cfg, width, cfg.dilation_growth_rate**j))
            layers += [nn.ELU(), _Conv(cfg, width, width * 2, kernel=2 * ratio, stride=ratio)]
            width *= 2
        layers += [_LSTM(cfg, width), nn.ELU(), _Conv(cfg, width, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Codebook(nn.Module):
    """The Euclidean codebook ``embed`` [codebook_size, dim] with the EMA training buffers of the checkpoint."""

    def __init__(self, cfg: AudioTokenizerConfig) -> None:
        super().__init__()
        self.register_buffer("inited", torch.ones(1))
        self.register_buffer("cluster_size", torch.zeros(cfg.codebook_size))
        self.register_buffer("embed", torch.zeros(cfg.codebook_size, cfg.codebook_dim))
        self.register_buffer("embed_avg", torch.zeros(cfg.codebook_size, cfg.codebook_dim))


class _Quantizer(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig) -> None:
        super().__init__()
        self.codebook = _Codebook(cfg)


def select_codes_by_distance(latents: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook vector (Euclidean) for every frame.

    Args:
        latents: ``[B, D, T]``. codebook: ``[N, D]``.

    Returns:
        LongTensor ``[B, T]``. The distance is expanded as ``|x|^2 - 2 x.e + |e|^2`` in the
        port's order of operations, so near ties resolve to the same index.
    """
    b, d, t = latents.shape
    x = latents.transpose(1, 2).reshape(-1, d)
    embed = codebook.t()
    neg_dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ embed + embed.pow(2).sum(0, keepdim=True))
    return neg_dist.max(dim=-1).indices.view(b, t)


def _as_batch(wave: Any, what: str) -> torch.Tensor:
    if isinstance(wave, (list, tuple)):
        arrs = [torch.as_tensor(np.asarray(w) if not isinstance(w, torch.Tensor) else w) for w in wave]
        if not arrs:
            raise ValueError(f"{what}: no clips")
        shapes = sorted({tuple(a.shape) for a in arrs})
        if len(shapes) > 1:
            raise ValueError(f"{what}: clips of different lengths {shapes} cannot share a batch (padding changes "
                             "codes); group them by exact length (encoders.group_by_shape, encoders.encode_audio)")
        return torch.stack(arrs)
    return torch.as_tensor(wave)


class AudioTokenizer(nn.Module):
    """The WavTokenizer audio tokenizer: 24 kHz mono waveforms -> ceil(T / 600) codebook indices per clip.

    Args:
        config: sizes (default: the released tokenizer).
        precision: ``"float32"`` (default, exact) or ``"tf32"`` (CUDA only); applied by :meth:`encode`.

    Batching: clips of one call must have the same length. Never pad clips to a common length
    (the codes near the end change); group clips with :func:`apertus_plugins.encoders.group_by_shape`
    or call :func:`apertus_plugins.encoders.encode_audio`, which does it.
    """

    def __init__(self, config: AudioTokenizerConfig | None = None, precision: Precision = "float32") -> None:
        super().__init__()
        self.config = config or AudioTokenizerConfig()
        self.precision: str = check_precision(precision)
        self.encoder = _Encoder(self.config)
        self.quantizer = _Quantizer(self.config)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.quantizer.codebook.embed.device

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    def check_ready(self) -> None:
        """Raise :class:`~apertus_plugins.encoders.precision.PrecisionError` on half weights or TF32 on CPU."""
        check_precision(self.precision, self.device)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            check_float32(t, f"audio tokenizer weight {name!r}")

    def latents(self, wave: torch.Tensor) -> torch.Tensor:
        """The encoder output ``[B, hidden_size, ceil(T/hop)]`` for ``[B, 1, T]`` (no checks, no scope)."""
        return self.encoder(wave)

    def encode(self, wave: torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Codebook indices of a batch of same-length clips.

        Args:
            wave: float32 ``[B, T]``, ``[B, 1, T]`` or one ``[T]`` at 24 kHz, as
                :func:`apertus_plugins.core.media.audio.preprocess_audio` returns it; a list of
                same-length clips is stacked. Clips of different lengths raise ``ValueError``.

        Returns:
            LongTensor ``[B, ceil(T / 600)]`` of indices in ``[0, codebook_size)`` (no vocabulary
            offset), on the tokenizer's device.
        """
        x = _as_batch(wave, "AudioTokenizer.encode")
        if x.dim() == 1:
            x = x[None, None]
        elif x.dim() == 2:
            x = x[:, None]
        if x.dim() != 3 or x.shape[1] != self.config.audio_channels:
            raise ValueError(f"AudioTokenizer.encode: expected [B, T] or [B, 1, T] mono audio, got shape {list(x.shape)}")
        if x.shape[0] == 0 or x.shape[-1] == 0:
            raise ValueError(f"AudioTokenizer.encode: empty input of shape {list(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"AudioTokenizer.encode: audio must be float32 samples, got {x.dtype}")
        if x.dtype != torch.float32:
            check_float32(x, "AudioTokenizer.encode: the audio")
        self.check_ready()
        x = x.to(self.device)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("AudioTokenizer.encode: the audio contains NaN or infinite samples")
        with torch.inference_mode(), precision_scope(self.precision), encode_threads(self.device), parametrize.cached():
            z = self.latents(x)
            if not bool(torch.isfinite(z).all()):
                raise PrecisionError("AudioTokenizer.encode: the encoder produced non-finite values (broken weights?)")
            codes = select_codes_by_distance(z, self.quantizer.codebook.embed)
        expected = -(-x.shape[-1] // self.hop_length)
        if codes.shape[-1] != expected:  # a config whose padding does not give whole frames
            raise AssertionError(f"AudioTokenizer.encode: {codes.shape[-1]} codes for {x.shape[-1]} samples, "
                                 f"expected {expected}")
        return codes
