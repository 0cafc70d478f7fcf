"""The eager CPU layers of the vLLM model (``vllm_model.eager``) give vLLM's own values.

Layer by layer (every bit, special values included, float32 and bfloat16), and end to end: the
suite's server (eager layers on) and a server with vLLM's layers (``APERTUS_VLLM_EAGER_LAYERS=0``)
return the same greedy tokens and the same log-probabilities, also for the requests whose
sampling works over the whole vocabulary: penalties with media and omni ids in the prompt, a
logit bias on a media id, and a batch of prompts of different lengths with penalties.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest
import torch
from conftest import server_args

from apertus_plugins.infra.client import http_json
from apertus_plugins.testing.serve import VLLMServer


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN payloads and signed zeros compared too)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def inputs(dtype: torch.dtype, n: int = 8, width: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, width, generator=g) * 3).to(dtype)
    special = torch.tensor([0.0, -0.0, 1e-7, -1e-7, -1e-6, 40.0, -40.0, 1e4], dtype=dtype)
    x[0, : special.numel()] = special
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_rms_norm_gives_vllms_bits(vllm_config, dtype):
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_model.eager import EagerRMSNorm

    ref = RMSNorm(256, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(256, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5)
    eager = RMSNorm(256, eps=1e-5, dtype=dtype)
    eager.load_state_dict(ref.state_dict())
    eager.__class__ = EagerRMSNorm
    x, residual = inputs(dtype), inputs(dtype).flip(0)
    with torch.inference_mode():
        assert torch.equal(bits(eager(x)), bits(ref(x)))
        got, got_res = eager(x.clone(), residual.clone())
        want, want_res = ref(x.clone(), residual.clone())
    assert torch.equal(bits(got), bits(want)) and torch.equal(bits(got_res), bits(want_res))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_xielu_gives_vllms_bits_and_follows_loaded_alphas(vllm_config, dtype):
    from vllm.model_executor.layers.activation import XIELU

    from apertus_plugins.core.xielu import xielu, xielu_inference
    from vllm_model.eager import EagerXIELU, refresh_eager_layers

    ref = XIELU(dtype=dtype)
    eager = XIELU(dtype=dtype)
    eager.__class__ = EagerXIELU
    x = torch.cat([inputs(dtype), torch.tensor([[float("inf"), float("-inf"), float("nan")] + [0.0] * 253],
                                               dtype=dtype)])
    with torch.inference_mode():
        assert torch.equal(bits(eager(x)), bits(ref(x)))  # the initial alphas
        for module in (ref, eager):  # a weight load replaces the alphas in place
            module.alpha_p.data.copy_(torch.tensor([0.37], dtype=dtype))
            module.alpha_n.data.copy_(torch.tensor([-1.3], dtype=dtype))
        refresh_eager_layers(eager)
        assert torch.equal(bits(eager(x)), bits(ref(x)))
        # the core's serving form equals the core's formula, with float scalars as well
        a_p = torch.nn.functional.softplus(ref.alpha_p)
        a_n = 0.5 + torch.nn.functional.softplus(ref.alpha_n)
        assert torch.equal(bits(xielu_inference(x, a_p, a_n)), bits(xielu(x, ref.alpha_p, ref.alpha_n)))


def test_eager_layers_only_where_the_values_stay_vllms(vllm_config, monkeypatch):
    from vllm.config import CompilationMode
    from vllm.model_executor.layers.activation import XIELU
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_model.eager import EAGER_ENV, EagerRMSNorm, EagerXIELU, eager_layers_apply, use_eager_layers

    vllm_config.compilation_config.mode = CompilationMode.NONE
    model = torch.nn.ModuleList([RMSNorm(64), XIELU(dtype=torch.float32), torch.nn.Linear(2, 2)])
    assert eager_layers_apply(vllm_config)
    monkeypatch.setenv(EAGER_ENV, "0")
    assert use_eager_layers(model, vllm_config) == 0 and type(model[0]) is RMSNorm
    monkeypatch.delenv(EAGER_ENV)
    vllm_config.compilation_config.mode = CompilationMode.DYNAMO_TRACE_ONCE  # torch.compile: vLLM's layers
    assert not eager_layers_apply(vllm_config)
    vllm_config.compilation_config.mode = CompilationMode.NONE
    assert use_eager_layers(model, vllm_config) == 2
    assert type(model[0]) is EagerRMSNorm and type(model[1]) is EagerXIELU and type(model[2]) is torch.nn.Linear


# ---------------------------------------------------------------------------------------------- end to end
MAX_TOKENS = 10


def requests(checkpoint: Path, image_part: dict) -> list[tuple[str, dict]]:
    """(endpoint, payload): greedy requests with log-probabilities over the sampling paths that see the whole vocabulary."""
    config = json.loads((checkpoint / "config.json").read_text())
    media_id = config["image_token_offset"] + 3  # an image code: never a text id
    common = {"model": "apertus", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    chat = {**common, "logprobs": True, "top_logprobs": 5, "prompt_logprobs": 2}
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.4}
    picture = [{"role": "user", "content": [image_part, {"type": "text", "text": "Describe it, describe it."}]}]
    return [
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "Hello, who are you?"}]}),
        ("/v1/chat/completions", {**chat, **penalties, "messages": picture}),
        ("/v1/chat/completions", {**chat, "messages": picture, "logit_bias": {str(media_id): 100}}),
        ("/v1/completions", {**common, **penalties, "logprobs": 5,
                             "prompt": ["Count: one two three one two three one two three", "Hi", "a b a b a b a"]}),
    ]


def answers(srv: VLLMServer, reqs: list[tuple[str, dict]]) -> list[dict]:
    def one(req: tuple[str, dict]) -> dict:
        status, body = http_json(srv.url(req[0]), req[1], timeout=600)
        assert status == 200, (req, body, srv.log_tail())
        for key in ("id", "created", "usage", "system_fingerprint", "service_tier", "kv_transfer_params"):
            body.pop(key, None)
        return body

    with cf.ThreadPoolExecutor(len(reqs)) as pool:  # together: the engine batches them
        return list(pool.map(one, reqs))


@pytest.mark.slow
def test_the_server_answers_as_with_vllms_layers(server, checkpoint, image_part, tmp_path_factory):
    reqs = requests(checkpoint, image_part)
    log = tmp_path_factory.mktemp("logs") / "vllm-vllm-layers.log"
    env = {"APERTUS_VLLM_EAGER_LAYERS": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # the suite server's executor too (a worker process of its own, one thread): the bodies must match bit for bit,
    # log-probabilities included, and the engine core's process computes with another thread count
    with VLLMServer(checkpoint, args=server_args(one_process=False), env=env, log_path=log, startup_timeout=900) as plain:
        want = answers(plain, reqs)
    got = answers(server, reqs)
    for (endpoint, _), g, w in zip(reqs, got, want, strict=True):
        assert g == w, endpoint
    # the media id with a bias of +100 is still never chosen: the text head cannot emit it
    biased = got[2]["choices"][0]["token_ids"]
    assert len(biased) == MAX_TOKENS and max(biased) < json.loads((checkpoint / "config.json").read_text())[
        "text_config"]["output_vocab_size"]
