"""The verl policy class's tensors load into the vLLM model by the vLLM model's own ``load_weights``.

verl syncs the trained ``Apertus1p5ForCausalLM`` (apertus_plugins.hf.modeling) to its vLLM rollout by
name: every entry of the class's state dict must be a name ``vllm_model``'s
``Apertus1p5ForConditionalGeneration.load_weights`` accepts, together covering every parameter of
the decoder and the head (the media tokenizers stay as loaded from the checkpoint).
"""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES
from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.testing.checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", init="varied")


@pytest.fixture(scope="module")
def vllm_model_instance(ckpt):
    """vllm_model's model built from the checkpoint's config by vLLM's config machinery, on one CPU rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs

    import vllm_model

    vllm_model.register()
    config = EngineArgs(model=str(ckpt), dtype="float32", enforce_eager=True).create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        try:
            initialize_model_parallel(1, 1)
            from vllm_model.model import Apertus1p5ForConditionalGeneration

            yield config, Apertus1p5ForConditionalGeneration(vllm_config=config).float()
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def test_state_dict_names_are_the_checkpoints_language_model_names(ckpt):
    ours = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert set(ours.state_dict()) == {k for k in tensors if not k.startswith(ENCODER_PREFIXES)}


def test_vllm_model_load_weights_takes_the_whole_state_dict(ckpt, vllm_model_instance):
    from vllm.config import set_current_vllm_config

    config, model = vllm_model_instance
    ours = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():  # move every tensor away from the checkpoint's values, as training would
        for p in ours.parameters():
            p.add_(0.5)
    state = ours.state_dict()
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(state.items()))  # an unknown name raises here
    params = dict(model.named_parameters())
    text_params = {n for n in params if not n.startswith(("vision_tokenizer.", "audio_tokenizer."))}
    assert text_params and text_params <= loaded
    # the values arrived where they belong (q, k and v stacked into one projection)
    attn = "model.language_model.layers.1.self_attn."
    qkv = torch.cat([state[attn + f"{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(params["language_model.layers.1.self_attn.qkv_proj.weight"], qkv)
    # vLLM pads its embedding and head to a multiple of 64 rows
    for vllm_name, name in (("lm_head.weight", "lm_head.weight"),
                            ("language_model.embed_tokens.weight", "model.language_model.embed_tokens.weight")):
        rows = state[name].shape[0]
        assert torch.equal(params[vllm_name][:rows], state[name]), vllm_name
    act = "language_model.layers.0.mlp.act_fn.alpha_p"
    assert torch.equal(params[act], state["model." + act])
