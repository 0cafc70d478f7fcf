"""Write a tiny random LlamaForCausalLM with the Apertus test tokenizer (run with the vllm environment).

    python _tiny_llama.py OUT_DIR

A stand-in until the Apertus vLLM plugin and ``apertus make-checkpoint`` land: the same test
tokenizer (with the Apertus chat template), a model vLLM serves natively (head dimension 64, as
its CPU attention needs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from apertus_plugins.tokenizer_builder import build_test_tokenizer
from apertus_plugins.vocab import VocabSpec


def main(out: str) -> None:
    out_dir = Path(out)
    spec = VocabSpec.scaled()
    build_test_tokenizer(out_dir, spec)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=spec.size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         bos_token_id=spec.bos_id, eos_token_id=spec.chat_ids["eos"], tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    # the turn and tool stops live in generation_config.json, as in the release
    gen = {"bos_token_id": spec.bos_id,
           "eos_token_id": [spec.chat_ids["eos"], spec.chat_ids["assistant_end"], spec.chat_ids["tools_suffix"]]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
