"""A randomly initialised EAGLE-3 head for an Apertus 1.5 checkpoint, in the ``speculators`` format.

An EAGLE-3 head is one Llama decoder layer that drafts from three of the target's hidden states
(concatenated, projected by ``fc``) and the embedding of the last token; vLLM loads it with
``--speculative-config '{"model": HEAD_DIR, "num_speculative_tokens": N}'`` (the method, ``eagle3``, is
read from the head's config) and shares the target's embedding (every id of the 1.5 vocabulary).
The head proposes text ids only: ``draft_vocab_size`` is the target's text vocabulary and ``d2t``
(draft id to target id offsets, all zero) maps them one to one. Random weights draft badly but
never change a greedy token: vLLM verifies every draft with the target.

The layout is what ``speculators`` writes and vLLM's ``vllm.transformers_utils.configs.speculators``
reads: a ``speculators_config`` (algorithm, proposal methods, verifier), the decoder layer's
``transformer_layer_config`` (a Llama config), ``draft_vocab_size``, ``target_hidden_size`` and
``eagle_aux_hidden_state_layer_ids``; tensors ``layers.0.*``, ``fc.weight`` ``[H, 3H]``,
``norm.weight``, ``lm_head.weight`` ``[draft_vocab, H]``, ``d2t`` and ``t2d``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import read_json

__all__ = ["ARCHITECTURE", "default_aux_layers", "write_eagle3_head"]

#: The ``architectures`` entry of a ``speculators`` EAGLE-3 checkpoint.
ARCHITECTURE = "Eagle3Speculator"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers for EAGLE-3 (``SupportsEagle3``: ``(2, L // 2, L - 3)``) where they are
    distinct layers of the model, else three spread over ``0..L`` (id k: the hidden state after k layers)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and all(0 <= i <= num_layers for i in ids):
        return ids
    return tuple(sorted({0, num_layers // 2, num_layers}))


def write_eagle3_head(checkpoint: str | Path, out_dir: str | Path, *, aux_layers: Sequence[int] | None = None,
                      num_speculative_tokens: int = 3, seed: int = 0, std: float = 0.02,
                      overrides: dict[str, Any] | None = None) -> Path:
    """Write a random EAGLE-3 head for ``checkpoint`` (an Apertus 1.5 checkpoint directory) to ``out_dir``.

    Args:
        aux_layers: the target layers whose hidden states the head reads (default :func:`default_aux_layers`).
        num_speculative_tokens: the proposal length the config carries (vLLM's default for the head).
        overrides: top-level config fields to replace (tests write mismatched heads with it).

    Returns:
        ``out_dir``.
    """
    import torch
    from safetensors.torch import save_file

    text = read_json(Path(checkpoint) / "config.json")["text_config"]
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter, vocab = int(text["intermediate_size"]), int(text["vocab_size"])
    draft_vocab = int(text.get("output_vocab_size") or vocab)
    layers = list(aux_layers) if aux_layers is not None else list(default_aux_layers(int(text["num_hidden_layers"])))
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": float(text["rms_norm_eps"]),
        "vocab_size": vocab, "max_position_embeddings": int(text["max_position_embeddings"]),
        "rope_theta": float((text.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": layers,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(checkpoint), "architectures": ["Apertus1p5ForConditionalGeneration"]},
        },
        "torch_dtype": "float32",
    }
    config.update(overrides or {})
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    p = "layers.0."
    tensors = {
        f"{p}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{p}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{p}mlp.gate_proj.weight": rand(inter, hidden),
        f"{p}mlp.up_proj.weight": rand(inter, hidden),
        f"{p}mlp.down_proj.weight": rand(hidden, inter),
        f"{p}input_layernorm.weight": torch.ones(hidden),
        f"{p}hidden_norm.weight": torch.ones(hidden),
        f"{p}post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": rand(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.long),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
