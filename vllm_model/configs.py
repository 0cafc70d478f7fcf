"""The Hugging Face config classes of Apertus 1.5 (their home is :mod:`apertus_plugins.hf.configs`)."""

from __future__ import annotations

from apertus_plugins.hf.configs import (
    DEFAULT_ROPE,
    Apertus1p5Config,
    Apertus1p5TextConfig,
    Apertus1p5VisionTokenizerConfig,
    WavTokenizerEncoderConfig,
    register,
)

__all__ = [
    "DEFAULT_ROPE",
    "Apertus1p5Config",
    "Apertus1p5TextConfig",
    "Apertus1p5VisionTokenizerConfig",
    "WavTokenizerEncoderConfig",
    "register",
]
