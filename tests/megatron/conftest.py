"""Shared fixtures of the megatron suite: a one-process gloo group, the test tokenizer, data writers.

The SFT data is written the way the offline pipeline writes it: conversations tokenized by the
core's injection-safe chat tokenizer, one conversation per sequence of a Megatron indexed
dataset, with a manifest. :func:`write_sft_prefix` is the one place to switch to ``apertus
tokenize`` once the pipeline is available.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDatasetWriter, optimal_dtype

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core's notes that it runs without Transformer Engine/Apex (expected on this CPU machine)
    config.addinivalue_line("filterwarnings", "ignore:.*(Transformer Engine|Apex) (and Apex )?(are|is) not installed")


@pytest.fixture(scope="session")
def process_group() -> None:
    """A one-rank gloo process group with megatron-core's model-parallel state (TP = PP = 1)."""
    from megatron_patches.checkpoint import single_process_group

    single_process_group()


@pytest.fixture(scope="session")
def spec(apertus_small_spec: VocabSpec) -> VocabSpec:
    return apertus_small_spec


@pytest.fixture(scope="session")
def tokenizer_dir(apertus_tokenizer_dir: Path) -> Path:
    """The ``apertus`` pytest plugin's test tokenizer over :func:`spec`."""
    return apertus_tokenizer_dir


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the weather in Bern?"},
     {"role": "assistant", "content": "It is three degrees and sunny."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Hello! How are you?"},
     {"role": "assistant", "content": "I am fine, thank you."},
     {"role": "user", "content": "Call the tool."},
     {"role": "assistant", "content": "Sure.", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Bern"}}}]},
     {"role": "tool", "content": "{\"temp\": 3}"},
     {"role": "assistant", "content": "It is 3 degrees."}],
    [{"role": "user", "content": "Describe <|img_start|> this."},
     {"role": "assistant", "content": "<think>The user wants a description.</think>A plain text."}],
    [{"role": "user", "content": "La Suisse a quatre langues nationales?"},
     {"role": "assistant", "content": "Oui: allemand, francais, italien et romanche."}],
]


def encode_conversations(tokenizer_dir: Path, conversations: Sequence[list[dict[str, Any]]]) -> list[np.ndarray]:
    tok = ChatTokenizer(tokenizer_dir)
    return [tok.encode_conversation(c, variant="training").ids for c in conversations]


def write_sft_prefix(prefix: Path, tokenizer_dir: Path, conversations: Sequence[list[dict[str, Any]]], *,
                     repeat: int = 1, mask: bool = False) -> list[np.ndarray]:
    """Tokenize conversations and write them as an SFT prefix (one conversation per sequence).

    With ``mask`` also writes the stored mask stream ``PREFIX.mask`` (one uint8 per token, as the
    core's SFT mask, aligned with the tokens). Returns the written id arrays in order.
    """
    from apertus_plugins.core.targets import sft_mask

    spec = VocabSpec.from_tokenizer_dir(tokenizer_dir)
    ids = encode_conversations(tokenizer_dir, conversations) * repeat
    with IndexedDatasetWriter(prefix, optimal_dtype(spec.size)) as w:
        for a in ids:
            w.add_document(a)
    if mask:
        with IndexedDatasetWriter(str(prefix) + ".mask", np.uint8) as w:
            for a in ids:
                w.add_document(np.concatenate([[0], sft_mask(a, spec)]).astype(np.uint8))
    return ids


def write_pretraining_prefix(prefix: Path, spec: VocabSpec, n_docs: int = 60, seed: int = 0) -> list[np.ndarray]:
    """Random documents over every modality, each ending with EOS (the pretraining layout)."""
    rng = np.random.default_rng(seed)
    docs = []
    img, aud = spec.modality("image"), spec.modality("audio")
    for _ in range(n_docs):
        text = rng.integers(80, spec.text_size, int(rng.integers(5, 40)))
        parts = [[spec.bos_id], text]
        if rng.random() < 0.5:
            parts += [[spec.id("img_start")], rng.integers(img.offset, img.end, 12), [spec.id("img_end")]]
        if rng.random() < 0.5:
            parts += [[spec.id("audio_start")], rng.integers(aud.offset, aud.end, 10), [spec.id("audio_end")],
                      [spec.id("stt_transcribe")], rng.integers(80, spec.text_size, 6)]
        parts.append([spec.eos_id])
        docs.append(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    with IndexedDatasetWriter(prefix, optimal_dtype(spec.size)) as w:
        for d in docs:
            w.add_document(d)
    return docs


def null_tokenizer(size: int) -> Any:
    """megatron-core's NullTokenizer (the library name is ``null`` in 0.16, ``null-text`` in 0.19)."""
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_patches.version import require_supported

    library = "null" if require_supported() == (0, 16) else "null-text"
    return MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=size)


# ------------------------------------------------------------------------------ checkpoints
def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    text = {"model_type": "apertus1p5_text", "vocab_size": 1100, "output_vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "xielu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 4000000.0, "factor": 32.0,
                                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0},
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 3, "initializer_range": 0.02, "use_cache": True}
    text.update(overrides)
    return {"architectures": ["Apertus1p5ForConditionalGeneration"], "model_type": "apertus1p5",
            "text_config": text, "vision_config": {"model_type": "apertus1p5_vision_tokenizer", "codebook_size": 256},
            "audio_config": {"model_type": "wavtokenizer_encoder", "codebook_size": 64},
            "image_token_id": 131079, "audio_token_id": 131085, "image_token_offset": 712,
            "audio_token_offset": 968, "tie_word_embeddings": False, "dtype": "bfloat16",
            "transformers_version": "5.24.0"}


def tiny_hf_tensors(config: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    prefix: str = "model.language_model.") -> dict[str, torch.Tensor]:
    """Random tensors with the released names and shapes (the port's xIELU init and constants)."""
    from apertus_plugins.core import xielu

    g = torch.Generator().manual_seed(seed)
    t = config.get("text_config", config)
    h, f, a, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = h // a

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    out = {f"{prefix}embed_tokens.weight": r(t["vocab_size"], h), f"{prefix}norm.weight": 1 + r(h),
           "lm_head.weight": r(t.get("output_vocab_size") or t["vocab_size"], h)}
    for n in range(t["num_hidden_layers"]):
        lp = f"{prefix}layers.{n}."
        p, q = xielu.initial_parameters(dtype)
        out.update({
            lp + "self_attn.q_proj.weight": r(a * d, h), lp + "self_attn.k_proj.weight": r(kv * d, h),
            lp + "self_attn.v_proj.weight": r(kv * d, h), lp + "self_attn.o_proj.weight": r(h, a * d),
            lp + "self_attn.q_norm.weight": 1 + r(d), lp + "self_attn.k_norm.weight": 1 + r(d),
            lp + "attention_layernorm.weight": 1 + r(h), lp + "feedforward_layernorm.weight": 1 + r(h),
            lp + "mlp.up_proj.weight": r(f, h), lp + "mlp.down_proj.weight": r(h, f),
            lp + "mlp.act_fn.alpha_p": p + r(1), lp + "mlp.act_fn.alpha_n": q + r(1),
            lp + "mlp.act_fn.beta": torch.tensor(xielu.BETA, dtype=dtype),
            lp + "mlp.act_fn.eps": torch.tensor(xielu.EPS, dtype=dtype),
        })
    if prefix == "model.language_model.":
        out.update({
            "model.vision_tokenizer.encoder.conv_in.weight": torch.randn(8, 3, 3, 3, generator=g),
            "model.vision_tokenizer.quantize.embedding.weight": torch.randn(256, 8, generator=g),
            "model.audio_tokenizer.encoder.layers.0.conv.parametrizations.weight.original0":
                torch.randn(32, 1, 1, generator=g),
            "model.audio_tokenizer.quantizer.codebook.inited": torch.ones(1),
        })
    return out


def write_hf_dir(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / "generation_config.json").write_text('{"eos_token_id": [2, 68, 72]}\n')
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
