"""LoRA adapters on the plugin's vLLM model (issue 34).

An adapter in PEFT's on-disk format (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``lora_B.weight`` of shape
``(out, r)``, scale ``lora_alpha / r``) on the q/k/v/o and MLP projections of the text-only causal LM
the verl plugin trains (:class:`apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`, module names taken
from that class) is served by ``vllm serve --enable-lora --lora-modules adapter=DIR`` over the tiny
checkpoint. Its greedy tokens must equal those of the checkpoint with the deltas merged into the
released tensors (``W + scale * B @ A``, :func:`apertus_plugins.testing.lora.write_merged_checkpoint`)
run by the same class in float32, and must differ from the base model's (the adapter is applied).
One server start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.infra.client import Client, http_json
from apertus_plugins.testing.lora import write_merged_checkpoint, write_peft_adapter
from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

RANK, ALPHA = 8, 16
PROMPTS = ([5, 17, 42, 99, 7, 64], [300, 12, 8, 250, 31])
MAX_TOKENS = 12


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
    deltas = write_peft_adapter(checkpoint, work / "adapter", rank=RANK, alpha=ALPHA)
    return work / "adapter", write_merged_checkpoint(checkpoint, deltas, work / "merged")


@pytest.fixture(scope="module")
def lora_server(checkpoint, lora_setup, tmp_path_factory):
    adapter, _ = lora_setup
    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", "apertus", "--max-num-seqs", "4",
            "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
            "--lora-modules", f"adapter={adapter}"]
    log = tmp_path_factory.mktemp("logs") / "vllm-lora.log"
    # adapters loaded at run time too (vLLM's /v1/load_lora_adapter), for the refusals below
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with VLLMServer(checkpoint, args=args, log_path=log, env=env, startup_timeout=900) as srv:
        # ONE_PROCESS_ARGS: the adapters are applied in the engine core's own process (no worker process)
        assert "(EngineCore pid=" in srv.log_tail(10_000) and "(Worker pid=" not in srv.log_tail(10_000)
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


@pytest.fixture(scope="module")
def vllm_model_with_lora(checkpoint):
    """The plugin's model built from the tiny checkpoint's config with ``--enable-lora``, on one CPU rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs

    import vllm_model
    from apertus_plugins.testing.serve import free_port

    vllm_model.register()
    config = EngineArgs(model=str(checkpoint), dtype="float32", enforce_eager=True, enable_lora=True,
                        max_lora_rank=RANK).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        try:
            initialize_model_parallel(1, 1)
            from vllm_model.model import Apertus1p5ForConditionalGeneration

            yield Apertus1p5ForConditionalGeneration(vllm_config=config)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def test_lora_mappings_match_the_models_modules(vllm_model_with_lora, checkpoint, tmp_path):
    """Every module a PEFT adapter on the text-only model names is a LoRA-capable layer of the vLLM
    model after vLLM's own renaming and packing; nothing in the media tokenizers takes LoRA."""
    from safetensors import safe_open
    from vllm.lora.utils import get_supported_lora_modules, parse_fine_tuned_lora_name
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.interfaces import supports_lora

    model = vllm_model_with_lora
    assert supports_lora(model)
    supported = set(get_supported_lora_modules(model))
    assert {"qkv_proj", "o_proj", "up_proj", "down_proj"} <= supported
    assert not supported & {"embed_tokens", "lm_head"}  # the embedding and the text head stay frozen
    mm = model.get_mm_mapping()
    assert mm.language_model == ["language_model"]
    assert set(mm.tower_model) == {"vision_tokenizer", "audio_tokenizer"}
    assert not model.supports_tower_connector_lora
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            assert name.startswith("language_model."), f"{name}: a LoRA-capable layer outside the decoder"

    write_peft_adapter(checkpoint, tmp_path / "adapter", rank=RANK, alpha=ALPHA)
    mapper = model.hf_to_vllm_mapper.get_rename_mapper()
    unpacked = {part: packed for packed, parts in model.packed_modules_mapping.items() for part in parts}
    modules = dict(model.named_modules())
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as fh:
        keys = list(fh.keys())
    assert len(keys) == 2 * 6 * len(model.language_model.layers)
    for key in keys:
        target, _ = parse_fine_tuned_lora_name(key, mapper)
        parent, leaf = target.rsplit(".", 1)
        vllm_name = f"{parent}.{unpacked.get(leaf, leaf)}"
        assert isinstance(modules.get(vllm_name), LinearBase), f"{key} -> {vllm_name}: not a linear layer"


def test_an_image_request_runs_with_the_adapter(lora_server, image_part):
    """Media go through the frozen tokenizers and the adapted decoder: the image's codes fill the prompt."""
    payload = {"model": "adapter", "max_tokens": 4, "temperature": 0.0,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part]}]}
    text_only = {**payload, "messages": [{"role": "user", "content": "What is this?"}]}
    with Client(lora_server.base_url, timeout=600) as client:
        with_image = client.json("POST", "/chat/completions", payload)
        without = client.json("POST", "/chat/completions", text_only)
    assert with_image["usage"]["completion_tokens"] == 4
    assert with_image["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 16


def _rewrite_adapter(src: Path, dst: Path, change) -> Path:
    """A copy of the adapter at ``src`` with ``change(name, tensor) -> (name, tensor)`` applied to every tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = dict(change(k, v) for k, v in load_file(str(src / "adapter_model.safetensors")).items())
    save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mismatched_adapters_are_refused_and_the_server_keeps_serving(lora_server, lora_setup, checkpoint, tmp_path):
    """An adapter that does not fit the served checkpoint (rank over --max-lora-rank, a hidden size of another
    model, a module this model does not have) is refused at load with a message naming the mismatch; the base
    model and the adapter already loaded keep serving the same tokens. The checks are vLLM's own loader's (the
    rank, the target modules, the shapes when the weights are placed); the plugin adds none and needs none."""
    import torch

    adapter, _ = lora_setup
    prompt = list(PROMPTS[0])
    before = {m: served_greedy(lora_server, m, prompt) for m in ("apertus", "adapter")}
    write_peft_adapter(checkpoint, tmp_path / "rank", rank=2 * RANK, alpha=ALPHA)
    bad = {
        "rank": (tmp_path / "rank", f"LoRA rank {2 * RANK} is greater than max_lora_rank {RANK}"),
        "hidden": (_rewrite_adapter(adapter, tmp_path / "hidden", lambda k, v: (
            k, torch.cat([v, torch.zeros(v.shape[0], 8)], dim=1) if "lora_A" in k else v)), "(128) must match the size "
                   "of tensor b (136)"),
        "module": (_rewrite_adapter(adapter, tmp_path / "module", lambda k, v: (k.replace("mlp.down_proj",
                                                                                          "mlp.router"), v)),
                   "expected target modules in"),
    }
    for name, (path, named) in bad.items():
        status, body = http_json(lora_server.url("/v1/load_lora_adapter"),
                                 {"lora_name": f"bad-{name}", "lora_path": str(path)}, timeout=300)
        # vLLM answers every failed load with 500 (its add_lora error path); the message is the loader's
        assert status == 500 and named in body["error"]["message"], (name, status, body)
    with Client(lora_server.base_url, timeout=60) as client:
        served = {m["id"] for m in client.json("GET", "/models")["data"]}
    assert served == {"apertus", "adapter"}
    assert {m: served_greedy(lora_server, m, prompt) for m in ("apertus", "adapter")} == before
