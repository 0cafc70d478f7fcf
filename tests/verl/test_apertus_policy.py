"""verl's FSDP engine loads a released-layout Apertus 1.5 checkpoint as ``Apertus1p5ForCausalLM``.

The module is built by verl's own code: ``HFModelConfig`` (``AutoConfig`` with the plugin's config
classes) and ``FSDPEngine._build_module`` (``get_hf_auto_model_class`` then ``from_pretrained``,
verl's monkey patches, gradient checkpointing), on the suite's tiny random checkpoint. Only the
FSDP wrapping, which needs an accelerator's device mesh, is left out.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES
from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.testing.serve import free_port


def _model_config(path, **override):
    from verl.workers.config import HFModelConfig

    # flash-attention 2 (verl's default) needs a GPU
    return HFModelConfig(path=str(path), override_config={"attn_implementation": "sdpa", **override},
                         use_remove_padding=False)


@pytest.fixture(scope="module")
def verl_module(apertus_checkpoint):
    """What verl's FSDP engine builds from ``actor_rollout_ref.model.path`` = the checkpoint (before FSDP wrapping)."""
    import torch.distributed as dist
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    started = not dist.is_initialized()
    if started:  # verl's init context asks for the rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model_config = _model_config(apertus_checkpoint)
        engine = FSDPEngine.__new__(FSDPEngine)  # __init__ builds a CUDA device mesh
        engine.model_config = model_config
        engine.engine_config = FSDPEngineConfig(forward_only=False, model_dtype="fp32", use_torch_compile=False)
        engine.device_mesh = None
        engine.use_remove_padding = model_config.use_remove_padding
        engine.ulysses_sequence_parallel_size = 1
        module = engine._build_module()
    finally:
        if started:
            dist.destroy_process_group()
    return module.eval()


def test_verl_picks_the_causal_lm_for_the_released_config(apertus_checkpoint):
    from transformers import AutoModelForCausalLM
    from verl.utils.model import get_hf_auto_model_class
    from verl.utils.transformers_compat import get_auto_model_for_vision2seq

    cfg = _model_config(apertus_checkpoint)
    assert cfg.architectures == ["Apertus1p5ForConditionalGeneration"]  # the checkpoint's, unchanged
    # the engine's choice, and the checkpoint manager's / model merger's for "...ForConditionalGeneration"
    picked = get_hf_auto_model_class(cfg.hf_config)
    assert picked is get_auto_model_for_vision2seq()
    assert picked._model_mapping[type(cfg.hf_config)] is Apertus1p5ForCausalLM
    assert AutoModelForCausalLM._model_mapping[type(cfg.hf_config)] is Apertus1p5ForCausalLM


def test_verl_loads_every_language_model_tensor_and_no_encoder(verl_module, apertus_checkpoint):
    assert type(verl_module) is Apertus1p5ForCausalLM
    assert verl_module.is_gradient_checkpointing  # verl's default
    tensors = load_file(str(apertus_checkpoint / "model.safetensors"))
    lm = {k: v for k, v in tensors.items() if not k.startswith(ENCODER_PREFIXES)}
    encoders = set(tensors) - set(lm)
    assert encoders and all(k.startswith(ENCODER_PREFIXES) for k in encoders)
    # the names verl syncs to the vLLM rollout (convert_weight_keys over the state dict) are the checkpoint's
    from verl.utils.model import convert_weight_keys

    state = convert_weight_keys(verl_module.state_dict(), verl_module)
    assert set(state) == set(lm)
    for name, value in lm.items():  # every tensor loaded, none left at its random init
        assert torch.equal(state[name], value.float()), name
    text = verl_module.config.text_config
    assert state["lm_head.weight"].shape == (text.output_vocab_size, text.hidden_size)
    assert state["model.language_model.embed_tokens.weight"].shape == (text.vocab_size, text.hidden_size)
    assert text.output_vocab_size < text.vocab_size


def test_logits_equal_transformers_apertus_causal_lm_on_the_same_tensors(verl_module, apertus_checkpoint):
    """The direct computation: transformers' ApertusForCausalLM on the checkpoint's decoder tensors, head rows padded."""
    from transformers import ApertusConfig, ApertusForCausalLM

    text = verl_module.config.text_config
    fields = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "output_vocab_size", "architectures")}
    direct = ApertusForCausalLM(ApertusConfig(**fields)).float().eval()
    tensors = load_file(str(apertus_checkpoint / "model.safetensors"))
    state = {k.replace("model.language_model.", "model.", 1): v.float() for k, v in tensors.items()
             if k.startswith("model.language_model.")}
    head = torch.zeros(text.vocab_size, text.hidden_size)
    head[: text.output_vocab_size] = tensors["lm_head.weight"].float()
    state["lm_head.weight"] = head
    missing, unexpected = direct.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    torch.manual_seed(0)
    ids = torch.randint(0, text.vocab_size, (2, 24))  # text ids and image/audio codes alike
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding, as verl's rollout batches are
    with torch.no_grad():
        got = verl_module(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = direct(input_ids=ids, attention_mask=mask, use_cache=False).logits[..., : text.output_vocab_size]
    assert got.shape == (2, 24, text.output_vocab_size)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, 5:], want[1, 5:], rtol=0, atol=1e-5)
    assert got.std() > 0.1  # the varied checkpoint shapes the output


def test_training_step_reaches_every_language_model_parameter(verl_module):
    """One cross-entropy step on text labels gives every decoder and head parameter a gradient."""
    model = verl_module.train()
    model.zero_grad()
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.text_config.output_vocab_size, (2, 16))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    model.zero_grad()
    model.eval()
    assert torch.isfinite(out.loss) and not no_grad, no_grad


def test_verls_model_merger_saves_the_text_weights_and_they_merge_back(verl_module, apertus_checkpoint, tmp_path,
                                                                     capsys):
    """verl's model merger writes the trained class as a Hugging Face directory; ``apertus merge-text-weights``
    puts those tensors back into the released checkpoint, whose encoders stay as they were."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from apertus_plugins.cli import main

    with torch.no_grad():
        trained = {k: (v + 0.25 * torch.sign(v)).clone() for k, v in verl_module.state_dict().items()}
    hf_dir = tmp_path / "hf"
    merger = FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", target_dir=str(hf_dir),
                                               hf_model_config_path=str(apertus_checkpoint),
                                               local_dir=str(tmp_path / "actor")))
    assert merger.get_transformers_auto_model_class()._model_mapping[type(merger.model_config)] is Apertus1p5ForCausalLM
    merger.save_hf_model_and_tokenizer(dict(trained))
    saved = load_file(str(hf_dir / "model.safetensors"))
    assert set(saved) == set(trained)  # text tensors only, under the released names (bfloat16, verl's choice)

    out = tmp_path / "merged"
    assert main(["merge-text-weights", str(hf_dir), str(apertus_checkpoint), str(out)]) == 0
    released = load_file(str(apertus_checkpoint / "model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    assert set(merged) == set(released)
    for name, value in merged.items():
        assert value.dtype == released[name].dtype, name
        want = released[name] if name.startswith(ENCODER_PREFIXES) else saved[name].to(value.dtype)
        assert torch.equal(value, want), name
    assert (out / "config.json").read_text() == (apertus_checkpoint / "config.json").read_text()
    assert not torch.equal(merged["lm_head.weight"], released["lm_head.weight"])

    # a directory without every text tensor is refused by name, and nothing is written
    from safetensors.torch import save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({k: v for k, v in saved.items() if k != "lm_head.weight"}, str(partial / "model.safetensors"))
    capsys.readouterr()
    assert main(["merge-text-weights", str(partial), str(apertus_checkpoint), str(tmp_path / "x")]) != 0
    assert re.search(r"partial: not the text weights .*missing \['lm_head.weight'\]", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()
    assert main(["merge-text-weights", str(hf_dir), str(apertus_checkpoint), str(out)]) != 0
    assert "the output directory exists" in capsys.readouterr().err
