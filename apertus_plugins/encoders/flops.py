"""Floating-point operations of the encoders, counted from the architecture (no torch needed).

Counts the multiply-accumulate work (2 FLOPs per multiply-add) of convolutions, matrix products
(attention, LSTM gates) and the codebook search; normalization, activations, softmax and padding
are left out (they are memory-bound and small next to the products). Used by the GPU benchmark to
set the floor that the device's measured convolution / matmul rate allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import AudioTokenizerConfig, VisionTokenizerConfig

__all__ = ["FlopCount", "vision_flops", "audio_flops"]


@dataclass
class FlopCount:
    """FLOPs by kind: ``conv`` (convolutions), ``matmul`` (attention / LSTM products), ``codebook`` (code search)."""

    conv: float = 0.0
    matmul: float = 0.0
    codebook: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.conv + self.matmul + self.codebook

    def add(self, kind: str, name: str, flops: float) -> None:
        setattr(self, kind, getattr(self, kind) + flops)
        self.parts[name] = self.parts.get(name, 0.0) + flops


def _conv2d(c_in: int, c_out: int, k: int, h_out: int, w_out: int) -> float:
    return 2.0 * c_in * c_out * k * k * h_out * w_out


def vision_flops(config: VisionTokenizerConfig, height: int, width: int, batch: int = 1) -> FlopCount:
    """FLOPs of encoding ``batch`` images of ``height`` x ``width`` pixels (multiples of 16)."""
    f = config.spatial_scale_factor
    if height % f or width % f or height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} is not a positive multiple of {f}")
    out = FlopCount()
    h, w = height, width
    out.add("conv", "conv_in", _conv2d(config.in_channels, config.base_channels, 3, h, w))
    widths = config.stage_widths
    c = config.base_channels

    def resblock(name: str, c_in: int, c_out: int) -> None:
        out.add("conv", name, _conv2d(c_in, c_out, 3, h, w) + _conv2d(c_out, c_out, 3, h, w)
                + (_conv2d(c_in, c_out, 1, h, w) if c_in != c_out else 0.0))

    def attention(name: str, ch: int) -> None:
        n = h * w
        out.add("conv", name, 4 * _conv2d(ch, ch, 1, h, w))  # q, k, v, proj_out
        out.add("matmul", name, 2.0 * n * n * ch * 2)  # q^T k and v w^T

    for s, width_s in enumerate(widths):
        for j in range(config.num_res_blocks):
            resblock(f"stage{s}.resnet", c if j == 0 else width_s, width_s)
            if config.stage_has_attention(s):
                attention(f"stage{s}.attention", width_s)
        c = width_s
        if s < len(widths) - 1:
            h, w = h // 2, w // 2
            out.add("conv", f"stage{s}.downsample", _conv2d(c, c, 3, h, w))
    resblock("mid.block_1", c, c)
    attention("mid.attn_1", c)
    resblock("mid.block_2", c, c)
    out.add("conv", "conv_out", _conv2d(c, config.latent_channels, 3, h, w))
    out.add("conv", "quant_conv", _conv2d(config.latent_channels, config.embed_dim, 1, h, w))
    out.add("codebook", "codebook", 2.0 * h * w * config.codebook_size * config.embed_dim)
    return _scaled(out, batch)


def _scaled(count: FlopCount, batch: int) -> FlopCount:
    return FlopCount(count.conv * batch, count.matmul * batch, count.codebook * batch,
                     {k: v * batch for k, v in count.parts.items()})


def _conv1d_out(length: int, kernel: int, stride: int, dilation: int = 1) -> int:
    """Output length of the encoder's padded convolution (padding completes the last frame)."""
    k_eff = (kernel - 1) * dilation + 1
    pad_total = k_eff - stride
    frames = -(-(length - k_eff + pad_total) // stride) + 1
    padded = (frames - 1) * stride + k_eff
    return (padded - k_eff) // stride + 1


def audio_flops(config: AudioTokenizerConfig, samples: int, batch: int = 1) -> FlopCount:
    """FLOPs of encoding ``batch`` clips of ``samples`` samples."""
    if samples <= 0:
        raise ValueError(f"a clip needs samples, got {samples}")
    out = FlopCount()
    t = samples

    def conv(name: str, c_in: int, c_out: int, k: int, stride: int = 1, dilation: int = 1) -> None:
        nonlocal t
        t_out = _conv1d_out(t, k, stride, dilation)
        out.add("conv", name, 2.0 * c_in * c_out * k * t_out)
        if stride > 1:
            t = t_out

    width = config.num_filters
    conv("conv_in", config.audio_channels, width, config.kernel_size)
    for s, ratio in enumerate(reversed(config.upsampling_ratios)):
        hidden = width // config.compress
        for j in range(config.num_residual_layers):
            conv(f"stage{s}.resblock", width, hidden, config.residual_kernel_size, 1, config.dilation_growth_rate**j)
            conv(f"stage{s}.resblock", hidden, width, 1)
            if config.use_conv_shortcut:
                conv(f"stage{s}.shortcut", width, width, 1)
        conv(f"stage{s}.downsample", width, width * 2, 2 * ratio, ratio)
        width *= 2
    # LSTM: per layer and step, four gates of (input + hidden) x hidden products
    out.add("matmul", "lstm", 2.0 * config.num_lstm_layers * t * 4 * width * (width + width))
    conv("conv_out", width, config.hidden_size, config.last_kernel_size)
    out.add("codebook", "codebook", 2.0 * t * config.codebook_size * config.codebook_dim)
    return _scaled(out, batch)
