"""The verl policy class ``Apertus1p5ForCausalLM`` against the released port, on the same tiny checkpoint.

``apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`` (transformers' ``ApertusModel`` decoder under the
released names, no encoders) must give the text logits of the port's
``Apertus1p5ForConditionalGeneration`` for text-only inputs, in float32, with the same loaded tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Apertus1p5ForConditionalGeneration

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES
from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM
from apertus_plugins.testing.checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", size="tiny", init="varied")


@pytest.fixture(scope="module")
def models(ckpt):
    port = Apertus1p5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    ours, info = Apertus1p5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    return port.eval(), ours.eval(), info


def test_loads_the_ports_language_model_tensors_and_nothing_else(models):
    port, ours, info = models
    # the encoders are ignored by declaration (_keys_to_ignore_on_load_unexpected): nothing else is left over
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"]
    port_state = {k: v for k, v in port.state_dict().items() if not k.startswith(ENCODER_PREFIXES)}
    ours_state = ours.state_dict()
    assert set(ours_state) == set(port_state)
    for name, value in ours_state.items():
        assert torch.equal(value, port_state[name]), name


def test_text_logits_equal_the_ports(models):
    port, ours, _ = models
    cfg = port.config
    placeholders = {cfg.image_token_id, cfg.audio_token_id}
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.text_config.vocab_size, (3, 40))
    for p in placeholders:  # a placeholder would ask the port for media features
        ids[ids == p] = 5
    ids[0, :8] = torch.arange(cfg.image_token_offset, cfg.image_token_offset + 8)  # code ids embed like any id
    mask = torch.ones_like(ids)
    mask[2, :6] = 0
    with torch.no_grad():
        want = port(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert got.shape == want.shape == (3, 40, cfg.text_config.output_vocab_size)
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=2e-6)
    torch.testing.assert_close(got[2, 6:], want[2, 6:], rtol=0, atol=2e-6)
    assert want.std() > 0.1
    # and as a causal LM: the loss on text labels is the port's cross-entropy
    labels = torch.randint(0, cfg.text_config.output_vocab_size, (3, 40))
    with torch.no_grad():
        loss = ours(input_ids=ids, labels=labels, use_cache=False).loss
        ref = torch.nn.functional.cross_entropy(port(input_ids=ids, use_cache=False).logits[:, :-1].flatten(0, 1),
                                                labels[:, 1:].flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
