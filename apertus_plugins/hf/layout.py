"""Tensor-name groups of a released Apertus 1.5 checkpoint (SPEC.md section 5); no dependencies."""

from __future__ import annotations

__all__ = ["ENCODER_PREFIXES", "LANGUAGE_MODEL_PREFIX", "LM_HEAD", "is_text_tensor"]

#: The decoder: every tensor under this prefix; its input embedding has every row of the vocabulary.
LANGUAGE_MODEL_PREFIX = "model.language_model."
#: The text head: ``output_vocab_size`` rows.
LM_HEAD = "lm_head.weight"
#: The media tokenizers (float32), which only the multimodal model runs.
ENCODER_PREFIXES = ("model.vision_tokenizer.", "model.audio_tokenizer.")


def is_text_tensor(name: str) -> bool:
    """Whether ``name`` belongs to the text-only causal LM (the decoder or the head)."""
    return name == LM_HEAD or name.startswith(LANGUAGE_MODEL_PREFIX)
