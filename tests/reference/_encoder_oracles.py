"""The released port's tokenizer models built on the same weights as ours (shared by the encoder tests)."""

from __future__ import annotations

import torch
from transformers.models.apertus1p5.configuration_apertus1p5 import Apertus1p5VisionTokenizerConfig
from transformers.models.apertus1p5.modeling_apertus1p5 import Apertus1p5VisionTokenizerModel
from transformers.models.wavtokenizer.configuration_wavtokenizer import WavTokenizerEncoderConfig
from transformers.models.wavtokenizer.modeling_wavtokenizer import WavTokenizerEncoderModel

from apertus_plugins.encoders import AudioTokenizer, VisionTokenizer


def port_vision(ours: VisionTokenizer) -> Apertus1p5VisionTokenizerModel:
    """``Apertus1p5VisionTokenizerModel`` with ``ours``'s config and weights (strict load)."""
    fields = {k: v for k, v in ours.config.to_dict().items() if k not in ("model_type", "spatial_scale_factor")}
    port = Apertus1p5VisionTokenizerModel(Apertus1p5VisionTokenizerConfig(**fields)).eval()
    port.load_state_dict(ours.state_dict(), strict=True)
    return port


def port_audio(ours: AudioTokenizer) -> WavTokenizerEncoderModel:
    """``WavTokenizerEncoderModel`` with ``ours``'s config and weights (strict load)."""
    fields = {k: v for k, v in ours.config.to_dict().items() if k != "model_type"}
    port = WavTokenizerEncoderModel(WavTokenizerEncoderConfig(**fields)).eval()
    port.load_state_dict(ours.state_dict(), strict=True)
    return port


@torch.inference_mode()
def port_image_codes(port: Apertus1p5VisionTokenizerModel, pixels: torch.Tensor) -> torch.Tensor:
    """The port's codes ``[B, rows, cols]`` for a same-shape batch, in strict float32."""
    return port.encode(pixels).image_tokens


@torch.inference_mode()
def port_audio_codes(port: WavTokenizerEncoderModel, wave: torch.Tensor) -> torch.Tensor:
    """The port's codes ``[B, n]`` for ``[B, T]`` same-length clips."""
    return port.encode(wave[:, None]).audio_codes[:, 0]
