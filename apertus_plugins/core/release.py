"""The released Apertus 1.5 model's constants, torch-free: the one place the tree reads them from.

- RoPE at the end of context extension (SPEC.md 5; report 3.4): llama3 scaling with factor 32 over
  an original context of 8,192, base 4M, for a context of 262,144 tokens (:func:`rope_parameters`).
- xIELU (SPEC.md 5): ``beta = 0.5``, ``eps = -1e-6``, initial ``alpha_p = alpha_n = 0.8``.
- The stops every server of the model must have (SPEC.md 3.6): the end of the assistant turn and
  the end of a tool call, beside the sequence terminator ``</s>`` (the tokenizer's ``eos_token``).

The serving image layout is the image modality's first registered layout
(:func:`apertus_plugins.plugins.serving_layout`); the id layout is :class:`apertus_plugins.core.vocab.VocabSpec`;
the released Hub ids are in :mod:`apertus_plugins.infra.release_ids` (beside the Hub lookups that alias them).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CONTEXT_LENGTH", "ROPE_FACTOR", "ROPE_HIGH_FREQ_FACTOR", "ROPE_LOW_FREQ_FACTOR", "ROPE_ORIGINAL_CONTEXT",
    "ROPE_THETA", "ROPE_TYPE", "STOP_TOKENS", "TERMINATOR", "XIELU_ALPHA_INIT", "XIELU_BETA", "XIELU_EPS",
    "rope_parameters",
]

ROPE_TYPE = "llama3"
ROPE_THETA = 4_000_000.0
ROPE_FACTOR = 32.0
ROPE_ORIGINAL_CONTEXT = 8192
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
CONTEXT_LENGTH = 262_144

XIELU_ALPHA_INIT = 0.8
XIELU_BETA = 0.5
XIELU_EPS = -1e-6

#: Token names (``VocabSpec`` names) generation must stop at: the end of the turn, the end of a call.
STOP_TOKENS = ("assistant_end", "tools_suffix")
#: The sequence terminator, the tokenizer's ``eos_token``.
TERMINATOR = "eos"


def rope_parameters(theta: float = ROPE_THETA, factor: float = ROPE_FACTOR) -> dict[str, Any]:
    """The ``rope_parameters`` of a transformers 5 text config (the released values by default)."""
    return {"rope_type": ROPE_TYPE, "rope_theta": float(theta), "factor": float(factor),
            "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT, "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_HIGH_FREQ_FACTOR}
