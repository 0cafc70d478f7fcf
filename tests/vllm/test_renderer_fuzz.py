"""The plugin's vLLM renderer on arbitrary requests (hypothesis): a prompt, or an error vLLM answers with a 4xx.

The renderer runs in-process, built by vLLM's own ``renderer_from_config`` from the tiny checkpoint.
Whatever the messages, tools and template kwargs hold (deep nesting, any Unicode, wrong types,
reasoning parts, broken media URLs), ``render_messages`` returns the core's ids or raises a
``ValueError``/``VLLMClientError`` (both a 400 or 422 in vLLM's error mapping), never another
exception, within a time bound per request size.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def renderer(checkpoint):
    import vllm_model

    vllm_model.register()
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.registry import renderer_from_config

    mc = ModelConfig(model=str(checkpoint), max_model_len=4096, limit_mm_per_prompt={"image": 2, "audio": 2})
    return renderer_from_config(VllmConfig(model_config=mc))


text = st.text(alphabet=st.characters(), max_size=30)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=False), text)
json_like = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(text, inner, max_size=3)), max_leaves=20)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": st.one_of(text, st.just("data:image/png;base64,AAAA"), st.just("file:///etc/hosts"))})}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries(
        {"data": st.sampled_from(["", "AAAA", "UklGRg=="]), "format": st.just("wav")})}),
    json_like)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
     "content": st.one_of(st.none(), text, st.lists(part, max_size=3), json_like)},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": text, "type": st.just("function"),
                                                            "function": st.fixed_dictionaries(
                                                                {"name": text, "arguments": st.one_of(text, json_like)})}),
                                     max_size=2),
              "reasoning": text})
tools = st.one_of(st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": text}, optional={"description": st.one_of(st.none(), text), "parameters": json_like})}),
    json_like), max_size=2))
template_kwargs = st.dictionaries(st.sampled_from(["enable_thinking", "add_generation_prompt", "other"]), scalar,
                                  max_size=2)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(messages=st.lists(message, max_size=4), tools=tools, kwargs=template_kwargs)
def test_any_request_renders_or_is_a_client_error(renderer, messages, tools, kwargs):
    from vllm.exceptions import VLLMClientError
    from vllm.renderers import ChatParams

    params = ChatParams(chat_template_kwargs={**kwargs, **({"tools": tools} if tools is not None else {})})
    start = time.perf_counter()
    try:
        _conversation, prompt = renderer.render_messages(messages, params)
    except (ValueError, VLLMClientError) as exc:
        assert "\ue000" not in str(exc) or "\ue000" in repr((messages, tools))
    else:
        assert isinstance(prompt["prompt_token_ids"], list) and prompt["prompt_token_ids"]
    assert time.perf_counter() - start < 10 + len(repr((messages, tools, kwargs))) * 1e-4
