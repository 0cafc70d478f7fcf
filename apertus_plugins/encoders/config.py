"""The encoder configs as plain dataclasses (no torch needed): sizes, defaults and checkpoint dicts.

The defaults are the released sizes; field names are the ``transformers`` port's, so a
checkpoint's ``vision_config`` / ``audio_config`` dict loads with ``from_dict`` (unknown keys such
as decoder fields are ignored) and ``to_dict`` writes them back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = ["VisionTokenizerConfig", "AudioTokenizerConfig"]

_GROUPS = 32

T = TypeVar("T")


def _config_from_dict(cls: type[T], data: Mapping[str, Any], what: str) -> T:
    """Build dataclass ``cls`` from ``data``: known fields are taken, unknown keys are ignored.

    Lists become tuples for tuple-typed fields (JSON has no tuples). ``what`` names the source in
    errors (a wrong type raises ``ValueError``).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: expected a mapping of config fields, got {type(data).__name__}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data or not f.init:
            continue
        value = data[f.name]
        if isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: {exc}") from exc


def _config_to_dict(obj: Any, model_type: str) -> dict[str, Any]:
    """The config's fields as JSON-ready values (tuples as lists) plus ``model_type``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    out["model_type"] = model_type
    return dict(sorted(out.items()))


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class VisionTokenizerConfig:
    """Sizes of the vision tokenizer; the defaults are the released Emu3.5 IBQ tokenizer.

    Field names are the port's (``Apertus1p5VisionTokenizerConfig``), so a checkpoint's
    ``vision_config`` dict loads with :meth:`from_dict` (unknown keys are ignored).

    Args:
        codebook_size: codebook entries (131,072).
        embed_dim: dimension of the codebook vectors and of the quantizer input (256).
        latent_channels: channels out of the encoder, into ``quant_conv`` (256).
        in_channels: image channels (3).
        base_channels: width of the first stage; stage ``s`` has ``base_channels * channel_multiplier[s]``.
        channel_multiplier: width factor per stage; the number of stages sets the downsampling
            factor ``2 ** (stages - 1)`` (16).
        num_res_blocks: residual blocks per stage (4).
        attn_resolutions: stage resolutions (``resolution / 2**stage``) that carry attention blocks.
        resolution: the reference resolution used with ``attn_resolutions`` (not an input size limit).
        dropout: unused at inference (kept for config round trips).
    """

    codebook_size: int = 131_072
    embed_dim: int = 256
    latent_channels: int = 256
    in_channels: int = 3
    base_channels: int = 256
    channel_multiplier: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 4
    attn_resolutions: tuple[int, ...] = (16,)
    resolution: int = 256
    dropout: float = 0.0

    model_type: ClassVar[str] = "apertus1p5_vision_tokenizer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "channel_multiplier", tuple(int(m) for m in self.channel_multiplier))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions))
        _check_positive(codebook_size=self.codebook_size, embed_dim=self.embed_dim,
                       latent_channels=self.latent_channels, in_channels=self.in_channels,
                       base_channels=self.base_channels, num_res_blocks=self.num_res_blocks,
                       resolution=self.resolution)
        if not self.channel_multiplier or min(self.channel_multiplier) <= 0:
            raise ValueError(f"channel_multiplier must be non-empty and positive, got {self.channel_multiplier}")
        for width in self.stage_widths:
            if width % _GROUPS:
                raise ValueError(f"stage width {width} is not a multiple of the {_GROUPS} GroupNorm groups "
                                 f"(base_channels {self.base_channels}, multipliers {self.channel_multiplier})")

    @property
    def spatial_scale_factor(self) -> int:
        """Pixels per code along each side (16)."""
        return 2 ** (len(self.channel_multiplier) - 1)

    @property
    def stage_widths(self) -> tuple[int, ...]:
        return tuple(self.base_channels * m for m in self.channel_multiplier)

    def stage_has_attention(self, stage: int) -> bool:
        return self.resolution // 2**stage in self.attn_resolutions

    @classmethod
    def from_dict(cls, data: dict[str, Any], what: str = "vision_config") -> VisionTokenizerConfig:
        """From a checkpoint's ``vision_config`` (unknown keys ignored)."""
        return _config_from_dict(cls, data, what)

    def to_dict(self) -> dict[str, Any]:
        """The port's ``vision_config`` dict (with ``model_type`` and ``spatial_scale_factor``)."""
        out = _config_to_dict(self, self.model_type)
        out["spatial_scale_factor"] = self.spatial_scale_factor
        return out

    @classmethod
    def tiny(cls) -> VisionTokenizerConfig:
        """A small config for tests: the released structure (16x16 patches) at width 32, 256 codes."""
        return cls(codebook_size=256, embed_dim=32, latent_channels=32, base_channels=32, num_res_blocks=1)



@dataclass(frozen=True)
class AudioTokenizerConfig:
    """Sizes of the audio tokenizer; the defaults are the released WavTokenizer (40 codes/s, 24 kHz).

    Field names are the port's (``WavTokenizerEncoderConfig``), so a checkpoint's ``audio_config``
    dict loads with :meth:`from_dict`; decoder fields and other unknown keys are ignored.

    Args:
        sampling_rate: input rate in Hz (24,000).
        audio_channels: input channels (1: mono).
        num_filters: width of the first convolution (32); each stage doubles it.
        upsampling_ratios: the decoder's ratios (6, 5, 5, 4); the encoder downsamples by them in
            reverse order, and their product is the hop (600 samples per code).
        num_residual_layers: residual blocks per stage (1).
        dilation_growth_rate: dilation growth across residual blocks (2).
        compress: width reduction inside the residual branches (2).
        use_conv_shortcut: a 1x1 convolution on the residual skip (True).
        use_causal_conv: pad on the left only (False).
        pad_mode: padding mode of the convolutions (``"reflect"``).
        norm_type: ``"weight_norm"`` (the only one supported).
        kernel_size, last_kernel_size, residual_kernel_size: 7, 7, 3.
        num_lstm_layers: 2.
        hidden_size: output channels of the encoder (512).
        codebook_size: 4,096.
        codebook_dim: must equal ``hidden_size``.
    """

    sampling_rate: int = 24_000
    audio_channels: int = 1
    num_filters: int = 32
    upsampling_ratios: tuple[int, ...] = (6, 5, 5, 4)
    num_residual_layers: int = 1
    dilation_growth_rate: int = 2
    compress: int = 2
    use_conv_shortcut: bool = True
    use_causal_conv: bool = False
    pad_mode: str = "reflect"
    norm_type: str = "weight_norm"
    kernel_size: int = 7
    last_kernel_size: int = 7
    residual_kernel_size: int = 3
    num_lstm_layers: int = 2
    hidden_size: int = 512
    codebook_size: int = 4096
    codebook_dim: int = 512

    model_type: ClassVar[str] = "wavtokenizer_encoder"

    def __post_init__(self) -> None:
        object.__setattr__(self, "upsampling_ratios", tuple(int(r) for r in self.upsampling_ratios))
        _check_positive(sampling_rate=self.sampling_rate, audio_channels=self.audio_channels,
                       num_filters=self.num_filters, num_residual_layers=self.num_residual_layers,
                       dilation_growth_rate=self.dilation_growth_rate, compress=self.compress,
                       kernel_size=self.kernel_size, last_kernel_size=self.last_kernel_size,
                       residual_kernel_size=self.residual_kernel_size, num_lstm_layers=self.num_lstm_layers,
                       hidden_size=self.hidden_size, codebook_size=self.codebook_size, codebook_dim=self.codebook_dim)
        if not self.upsampling_ratios or min(self.upsampling_ratios) <= 0:
            raise ValueError(f"upsampling_ratios must be non-empty and positive, got {self.upsampling_ratios}")
        if self.norm_type != "weight_norm":
            raise ValueError(f"norm_type {self.norm_type!r} is not supported; the released encoder uses 'weight_norm'")
        if self.codebook_dim != self.hidden_size:
            raise ValueError(f"codebook_dim ({self.codebook_dim}) must equal hidden_size ({self.hidden_size}): "
                             "WavTokenizer has no projection around the quantizer")
        if self.pad_mode not in ("reflect", "constant", "replicate", "circular"):
            raise ValueError(f"unknown pad_mode {self.pad_mode!r}")

    @property
    def hop_length(self) -> int:
        """Samples per code (600)."""
        return math.prod(self.upsampling_ratios)

    @classmethod
    def from_dict(cls, data: dict[str, Any], what: str = "audio_config") -> AudioTokenizerConfig:
        """From a checkpoint's ``audio_config`` (unknown keys, e.g. decoder fields, ignored)."""
        return _config_from_dict(cls, data, what)

    def to_dict(self) -> dict[str, Any]:
        """The encoder fields of the port's ``audio_config`` dict, with ``model_type``."""
        return _config_to_dict(self, self.model_type)

    @classmethod
    def tiny(cls) -> AudioTokenizerConfig:
        """A small config for tests: the released structure (hop 600) with 8 filters and 64 codes."""
        return cls(num_filters=8, hidden_size=32, codebook_dim=32, codebook_size=64)
