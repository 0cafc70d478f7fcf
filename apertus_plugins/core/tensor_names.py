"""Tensor-name groups of a released Apertus 1.5 checkpoint (SPEC.md section 5); no dependencies.

The one home of these names: the checkpoint writer, the encoder loaders, the converters, the doctor,
the ``transformers`` causal LM and the vLLM model take them from here.
"""

from __future__ import annotations

__all__ = ["AUDIO_PREFIX", "EMBEDDING", "ENCODER_PREFIXES", "LANGUAGE_MODEL_PREFIX", "LM_HEAD", "VISION_PREFIX",
           "is_text_tensor"]

#: The decoder: every tensor under this prefix; its input embedding has every row of the vocabulary.
LANGUAGE_MODEL_PREFIX = "model.language_model."
#: The input embedding (all vocabulary rows).
EMBEDDING = LANGUAGE_MODEL_PREFIX + "embed_tokens.weight"
#: The text head: ``output_vocab_size`` rows.
LM_HEAD = "lm_head.weight"
#: The media tokenizers (float32), which only the multimodal model runs.
VISION_PREFIX = "model.vision_tokenizer."
AUDIO_PREFIX = "model.audio_tokenizer."
ENCODER_PREFIXES = (VISION_PREFIX, AUDIO_PREFIX)


def is_text_tensor(name: str) -> bool:
    """Whether ``name`` belongs to the text-only causal LM (the decoder or the head)."""
    return name == LM_HEAD or name.startswith(LANGUAGE_MODEL_PREFIX)
