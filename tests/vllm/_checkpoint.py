"""A tiny random checkpoint in the released layout, for the vllm suite.

Stand-in until the project's checkpoint writer (``apertus make-checkpoint``) is on main: the
released tensor names (``model.language_model.*``, ``model.vision_tokenizer.*``,
``model.audio_tokenizer.*``, ``lm_head.weight`` of ``output_vocab_size`` rows), the test
tokenizer with the scaled 1.5 id layout, and a generation config with the turn and tool stops.
Head dimension 64 (vLLM's CPU attention rejects smaller ones).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from apertus_plugins.encoders import AudioTokenizer, AudioTokenizerConfig, VisionTokenizer, VisionTokenizerConfig
from apertus_plugins.tokenizer_builder import build_test_tokenizer
from apertus_plugins.vocab import VocabSpec


def write_checkpoint(out: str | Path, hidden: int = 128, layers: int = 2, heads: int = 2, intermediate: int = 256,
                     seed: int = 0, generation_config: bool = True) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = VocabSpec.scaled(embedding_padding=56)
    build_test_tokenizer(out, spec)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    rows, head_dim = spec.embedding_rows, hidden // heads
    lm = "model.language_model."
    sd = {lm + "embed_tokens.weight": rnd(rows, hidden, std=1.0)}
    for i in range(layers):
        p = f"{lm}layers.{i}."
        for n in "qkvo":
            sd[p + f"self_attn.{n}_proj.weight"] = rnd(hidden, hidden, std=0.08)
        sd[p + "self_attn.q_norm.weight"] = 1 + rnd(head_dim, std=0.1)
        sd[p + "self_attn.k_norm.weight"] = 1 + rnd(head_dim, std=0.1)
        sd[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden, std=0.08)
        sd[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate, std=0.08)
        sd[p + "mlp.act_fn.alpha_p"] = torch.tensor([math.log(math.expm1(0.8))]) + rnd(1, std=0.05)
        sd[p + "mlp.act_fn.alpha_n"] = torch.tensor([math.log(math.expm1(0.3))]) + rnd(1, std=0.05)
        sd[p + "attention_layernorm.weight"] = 1 + rnd(hidden, std=0.1)
        sd[p + "feedforward_layernorm.weight"] = 1 + rnd(hidden, std=0.1)
    sd[lm + "norm.weight"] = 1 + rnd(hidden, std=0.1)
    sd["lm_head.weight"] = rnd(spec.text_size, hidden, std=0.3)
    torch.manual_seed(seed + 1)
    vc, ac = VisionTokenizerConfig.tiny(), AudioTokenizerConfig.tiny()
    for prefix, module in (("model.vision_tokenizer.", VisionTokenizer(vc)), ("model.audio_tokenizer.", AudioTokenizer(ac))):
        sd.update({prefix + k: v.contiguous() for k, v in module.state_dict().items()})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    image, audio = spec.modality("image"), spec.modality("audio")
    rope = {"rope_type": "llama3", "rope_theta": 4000000.0, "factor": 32.0, "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = {
        "architectures": ["Apertus1p5ForConditionalGeneration"], "model_type": "apertus1p5", "dtype": "float32",
        "image_token_id": spec.id("image"), "audio_token_id": spec.id("audio"),
        "image_token_offset": image.offset, "audio_token_offset": audio.offset, "tie_word_embeddings": False,
        "text_config": {"model_type": "apertus1p5_text", "vocab_size": rows, "output_vocab_size": spec.text_size,
                        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                        "num_attention_heads": heads, "num_key_value_heads": heads, "hidden_act": "xielu",
                        "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                        "rope_parameters": rope},
        "vision_config": vc.to_dict(), "audio_config": ac.to_dict(),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation_config:
        gen = {"bos_token_id": spec.bos_id, "pad_token_id": spec.pad_id,
               "eos_token_id": [spec.eos_id, spec.id("assistant_end"), spec.id("tools_suffix")]}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
