"""LoRA adapters on the plugin's vLLM model (issue 34).

An adapter in PEFT's on-disk format (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``lora_B.weight`` of shape
``(out, r)``, scale ``lora_alpha / r``) on the q/k/v/o and MLP projections of the text-only causal LM
the verl plugin trains (:class:`apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`, module names taken
from that class) is served by ``vllm serve --enable-lora --lora-modules adapter=DIR`` over the tiny
checkpoint. Its greedy tokens must equal those of the checkpoint with the deltas merged into the
released tensors (``W + scale * B @ A``, written by :func:`apertus_plugins.hf.merge.merge_text_weights`)
run by the same class in float32, and must differ from the base model's (the adapter is applied).
One server start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from apertus_plugins.hf.merge import merge_text_weights, tensor_files
from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.infra.client import Client
from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

#: The projections a PEFT run on the text-only model targets (attention and MLP; Apertus has no gate).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 16
PROMPTS = ([5, 17, 42, 99, 7, 64], [300, 12, 8, 250, 31])
MAX_TOKENS = 12


def write_peft_adapter(base: Path, out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a PEFT-format LoRA adapter for ``base``'s text-only causal LM; return the merged deltas by
    released tensor name (``scale * B @ A``)."""
    model = Apertus1p5ForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    scale = ALPHA / RANK
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS):
            continue
        out_f, in_f = module.weight.shape
        a = torch.randn(RANK, in_f, generator=gen) / in_f**0.5
        b = torch.randn(out_f, RANK, generator=gen) * 0.05
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        deltas[f"{name}.weight"] = scale * b @ a
    assert len(deltas) == len(TARGETS) * model.config.text_config.num_hidden_layers
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
              "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "target_modules": list(TARGETS),
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return deltas


def write_merged(base: Path, deltas: dict[str, torch.Tensor], work: Path) -> Path:
    """The released checkpoint with ``W + delta`` on the released tensor names."""
    trained: dict[str, torch.Tensor] = {}
    for name, file in tensor_files(base).items():
        if name.startswith("model.language_model.") or name == "lm_head.weight":
            trained[name] = load_file(str(file))[name]
    for name, delta in deltas.items():
        assert name in trained, name  # the adapter's modules are the checkpoint's tensors
        trained[name] = (trained[name].float() + delta).to(trained[name].dtype)
    (work / "trained").mkdir()
    save_file(trained, str(work / "trained" / "model.safetensors"), metadata={"format": "pt"})
    return merge_text_weights(work / "trained", base, work / "merged")


def greedy_reference(ckpt: Path, prompt: list[int], n: int) -> list[int]:
    model = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def lora_setup(checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    deltas = write_peft_adapter(checkpoint, work / "adapter")
    merged = write_merged(checkpoint, deltas, work)
    return work / "adapter", merged


@pytest.fixture(scope="module")
def lora_server(checkpoint, lora_setup, tmp_path_factory):
    adapter, _ = lora_setup
    args = [*CPU_ARGS, "--dtype", "float32", "--served-model-name", "apertus", "--max-num-seqs", "4",
            "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
            "--lora-modules", f"adapter={adapter}"]
    log = tmp_path_factory.mktemp("logs") / "vllm-lora.log"
    with VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900) as srv:
        yield srv


def served_greedy(server: VLLMServer, model: str, prompt: list[int]) -> list[int]:
    payload = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
               "ignore_eos": True, "return_token_ids": True}
    with Client(server.base_url, timeout=300) as client:
        body = client.json("POST", "/completions", payload)
    return list(body["choices"][0]["token_ids"])


def test_adapter_is_listed(lora_server):
    with Client(lora_server.base_url, timeout=60) as client:
        models = client.json("GET", "/models")
    ids = {m["id"]: m for m in models["data"]}
    assert "adapter" in ids and ids["adapter"].get("parent") == "apertus", models


@pytest.mark.parametrize("prompt", PROMPTS)
def test_adapter_greedy_tokens_equal_merged_weights(lora_server, lora_setup, checkpoint, prompt):
    _, merged = lora_setup
    with_adapter = served_greedy(lora_server, "adapter", list(prompt))
    base = served_greedy(lora_server, "apertus", list(prompt))
    # the reference path reproduces the served base model (so a match below is not an accident)
    assert base == greedy_reference(checkpoint, list(prompt), MAX_TOKENS)
    assert with_adapter == greedy_reference(merged, list(prompt), MAX_TOKENS)
    assert with_adapter != base, "the adapter did not change a single greedy token"
