"""Images whose codes the media-code cache holds reach the engine as token ids (``vllm_model.known_media``).

One server with ``APERTUS_MEDIA_CACHE`` on: the same request is served on the multimodal path
(``media_as_text: false``) and as text, and the greedy tokens and their log-probabilities agree; the
text path's prompt holds the codes' ids where the multimodal one holds placeholders, the encoder does
not run for it, a request mixing a known and an unknown image is split between both paths, and a
repeated image is served by vLLM's prefix cache.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time

import numpy as np
import pytest
from conftest import server_args

from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.infra.client import http_json
from apertus_plugins.testing.serve import VLLMServer

MAX_TOKENS = 6
READY = "reach the engine as token ids"


def png_part(seed: int, side: int = 64) -> dict:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


@pytest.fixture(scope="module")
def cached_server(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("as-text")
    env = {"APERTUS_MEDIA_CACHE": str(tmp / "codes"), "APERTUS_VLLM_CODES_LOG": str(tmp / "codes.jsonl"),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    with VLLMServer(checkpoint, args=[*server_args(), "--enable-prefix-caching", "--trust-request-mm-kwargs"], env=env,
                    log_path=tmp / "vllm.log", startup_timeout=900) as srv:
        deadline = time.monotonic() + 120
        while READY not in srv.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.5)
        yield srv, tmp / "codes.jsonl"


def chat(server, content, as_text: bool | None = None, status: int = 200) -> dict:
    payload = {"model": "apertus", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
               "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 3}
    if as_text is not None:
        payload["mm_processor_kwargs"] = {"media_as_text": as_text}
    got, body = http_json(server.url("/v1/chat/completions"), payload, timeout=600)
    assert got == status, body
    return body


def answer(body: dict) -> tuple[list[int], np.ndarray]:
    choice = body["choices"][0]
    lps = [[t["logprob"] for t in step["top_logprobs"]] for step in choice["logprobs"]["content"]]
    return choice["token_ids"], np.asarray(lps)


def encoded(log) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def prefix_hits(server) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url("/metrics"), timeout=60) as resp:  # noqa: S310 - loopback
        text = resp.read().decode()
    found = re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, flags=re.M)
    assert found, "vllm:prefix_cache_hits_total not in /metrics"
    return sum(float(v) for v in found)


def test_known_images_replace_their_placeholders_and_a_grid_of_another_shape_is_not_served(checkpoint):
    from apertus_plugins.core.media import image as media_image
    from vllm_model.known_media import known_sequence, substitute_images

    assert substitute_images([1, 5, 2, 5, 3], 5, [[8, 9], None]) == [1, 8, 9, 2, 5, 3]
    assert substitute_images([1, 5, 2], 5, [[8], [9]]) is None  # one placeholder, two images: left alone
    core = ChatTokenizer(checkpoint)
    info = type("Info", (), {"spec": core.spec, "chat_tokenizer": core})()
    options = {"resize_policy": "released", "image_layout": "inference"}
    rows, cols = media_image.image_grid(64, 48, "released")
    grid = np.arange(rows * cols).reshape(rows, cols)
    seq = known_sequence(grid, (64, 48), info, options)
    assert seq is not None and seq.tolist() == media_image.image_sequence(grid, core.spec, "inference",
                                                                          core.char_ids).tolist()
    assert known_sequence(grid.T if rows != cols else grid[:, :-1], (64, 48), info, options) is None
    assert known_sequence(grid + core.spec.modality("image").size, (64, 48), info, options) is None


@pytest.mark.slow
def test_a_stored_image_is_served_as_text_with_the_multimodal_paths_tokens(cached_server, checkpoint, image_part):
    server, log = cached_server
    spec = ChatTokenizer(checkpoint).spec
    placeholder = spec.id(spec.media_kind("image").placeholder)
    image = spec.modality("image")
    content = [{"type": "text", "text": "Describe: "}, image_part]

    start = encoded(log)  # vLLM's profiling run may have encoded dummy images
    mm = chat(server, content, as_text=False)  # encodes the image once and stores its codes
    assert encoded(log) == start + 1
    ids_mm = mm["prompt_token_ids"]
    assert placeholder in ids_mm

    text = chat(server, content)
    ids_text = text["prompt_token_ids"]
    assert encoded(log) == start + 1, "the encoder ran for an image the cache holds"
    assert placeholder not in ids_text and len(ids_text) == len(ids_mm)
    codes = [t for t, p in zip(ids_text, ids_mm, strict=True) if p == placeholder]
    assert codes and all(image.offset <= t < image.offset + image.size for t in codes)
    assert [t for t, p in zip(ids_text, ids_mm, strict=True) if p != placeholder] == \
        [p for p in ids_mm if p != placeholder]

    tokens_mm, lp_mm = answer(mm)
    tokens_text, lp_text = answer(text)
    assert tokens_text == tokens_mm
    np.testing.assert_allclose(lp_text, lp_mm, rtol=0, atol=1e-4)

    # the same image again, now through the raw-bytes index (not decoded in the API server): the same
    # prompt and answer, and vLLM's prefix cache serves its blocks as it serves repeated text
    before = prefix_hits(server)
    again = chat(server, content)
    assert again["prompt_token_ids"] == ids_text
    assert answer(again)[0] == tokens_mm and prefix_hits(server) - before >= len(codes) // 2
    np.testing.assert_allclose(answer(again)[1], lp_mm, rtol=0, atol=1e-4)

    # a known and an unknown image in one request: the known one as ids, the new one through the encoder
    mixed = [image_part, {"type": "text", "text": " and "}, png_part(7)]
    got = chat(server, mixed)
    assert encoded(log) == start + 2  # the new image only
    want = chat(server, mixed, as_text=False)  # both through the multimodal path (both now from the cache)
    assert encoded(log) == start + 2
    assert got["prompt_token_ids"].count(placeholder) == want["prompt_token_ids"].count(placeholder) - len(codes) > 0
    assert answer(got)[0] == answer(want)[0]
    np.testing.assert_allclose(answer(got)[1], answer(want)[1], rtol=0, atol=1e-4)

    # a bad value of the option is the request's 400
    body = chat(server, content, as_text="yes", status=400)  # type: ignore[arg-type]
    assert "media_as_text" in json.dumps(body)
