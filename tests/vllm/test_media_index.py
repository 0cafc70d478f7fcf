"""The raw-bytes index of known images (``vllm_model.known_media``): a repeated data URL skips decoding.

The plugin's renderer runs in-process (built by vLLM's ``renderer_from_config`` from the tiny
checkpoint) with the media-code cache on; the codes are stored by the real vision encoder through
``encode_images``, as the engine's model stores them. The first request with an image decodes it,
finds its codes by its pixels and indexes its encoded bytes; the next one with the same data URL is
served from the index without vLLM decoding the image, with the same prompt ids. An image the index
lacks takes the full path; an index entry moved under another image's key is a miss (removed), the
image's own codes are served and its entry is written again.
"""

from __future__ import annotations

import asyncio
import base64
import io
import shutil

import numpy as np
import pytest

from apertus_plugins.core.chat import ChatTokenizer


def png_bytes(seed: int, side: int = 64) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side + 16, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def url_of(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def renderer(checkpoint, tmp_path_factory):
    """The renderer of a server whose media-code cache is on, its fingerprint taken."""
    import vllm_model

    vllm_model.register()
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.registry import renderer_from_config

    cache_dir = tmp_path_factory.mktemp("index") / "codes"
    mp = pytest.MonkeyPatch()
    mp.setenv("APERTUS_MEDIA_CACHE", str(cache_dir))
    try:
        mc = ModelConfig(model=str(checkpoint), max_model_len=4096, limit_mm_per_prompt={"image": 2, "audio": 2})
        out = renderer_from_config(VllmConfig(model_config=mc))
    finally:
        mp.undo()
    assert out.known_images is not None and out.known_images.wait(300), "the fingerprint was not taken"
    return out


@pytest.fixture(scope="module")
def store_codes(renderer, checkpoint):
    """Encode images with the served model's vision encoder into the renderer's cache (as the engine does)."""
    from apertus_plugins.core.media import image as media_image
    from apertus_plugins.encoders import encode_images, load_vision_tokenizer

    tok = load_vision_tokenizer(checkpoint, precision="float32")

    def store(data: bytes) -> np.ndarray:
        pre = media_image.preprocess_image(media_image.decode_image(media_image.open_image(data)))
        return encode_images(tok, [pre], batch_size=1, cache=renderer.known_images.cache)[0]

    return store


@pytest.fixture
def decodes(monkeypatch):
    """How many images vLLM's media loader decodes (its ``ImageMediaIO.load_bytes`` calls)."""
    from vllm.multimodal.media import image as vllm_image

    calls: list[int] = []
    real = vllm_image.ImageMediaIO.load_bytes

    def counted(self, data):  # noqa: ANN001
        calls.append(len(data))
        return real(self, data)

    monkeypatch.setattr(vllm_image.ImageMediaIO, "load_bytes", counted)
    return calls


def render(renderer, content, as_text: bool = True, sync: bool = False) -> dict:
    from vllm.renderers import ChatParams

    params = ChatParams(mm_processor_kwargs={"media_as_text": as_text})
    messages = [{"role": "user", "content": content}]
    if sync:
        return renderer.render_messages(messages, params)[1]
    return asyncio.run(renderer.render_messages_async(messages, params))[1]


def content_of(*images: bytes) -> list[dict]:
    out: list[dict] = [{"type": "text", "text": "Look: "}]
    for data in images:
        out.append({"type": "image_url", "image_url": {"url": url_of(data)}})
    return out


def decode_settings(renderer) -> str:
    from vllm.renderers import ChatParams

    params = ChatParams()
    return renderer._decode_settings(params, renderer._media_options(params))


def test_a_known_image_is_indexed_then_served_without_decoding(renderer, store_codes, decodes, checkpoint):
    data = png_bytes(1)
    grid = store_codes(data)
    known = renderer.known_images
    decode = decode_settings(renderer)
    assert known.indexed(data, decode) is None

    reference = render(renderer, content_of(data), as_text=False)  # the multimodal path: placeholders
    first = render(renderer, content_of(data))  # found by its pixels; its bytes are indexed now
    assert len(decodes) == 2 and "multi_modal_data" not in first
    entry = known.indexed(data, decode)
    assert entry is not None and entry[1] == (64, 80)

    again = render(renderer, content_of(data))  # the index: no decode
    assert len(decodes) == 2, "vLLM decoded an image the index holds"
    assert again["prompt_token_ids"] == first["prompt_token_ids"] and "multi_modal_data" not in again
    assert render(renderer, content_of(data), sync=True)["prompt_token_ids"] == first["prompt_token_ids"]
    assert len(decodes) == 2

    # the prompt is the multimodal one with the image's placeholder replaced by the stored grid's sequence
    from apertus_plugins.core.media import image as media_image
    from vllm_model.known_media import substitute_images

    core = ChatTokenizer(checkpoint)
    placeholder = core.spec.id(core.spec.media_kind("image").placeholder)
    sequence = media_image.image_sequence(grid, core.spec, "inference", core.char_ids)
    assert reference["prompt_token_ids"].count(placeholder) == 1
    assert again["prompt_token_ids"] == substitute_images(reference["prompt_token_ids"], placeholder, [sequence])


def test_the_index_keeps_requests_with_their_own_decoder_settings_and_images_the_same_request_repeats(
        renderer, store_codes, decodes):
    from vllm.renderers import ChatParams

    data = png_bytes(2)
    store_codes(data)
    first = render(renderer, content_of(data, data))  # indexed (both items: one key)
    assert len(decodes) == 2 and "multi_modal_data" not in first
    again = render(renderer, content_of(data, data))
    assert len(decodes) == 2 and again["prompt_token_ids"] == first["prompt_token_ids"]
    # the request's own decoder options are not what the index was written for: the full path
    params = ChatParams(media_io_kwargs={"image": {"image_mode": "RGB"}})
    assert renderer._decode_settings(params, renderer._media_options(params)) is None
    own = asyncio.run(renderer.render_messages_async([{"role": "user", "content": content_of(data)}], params))[1]
    assert len(decodes) == 3 and "multi_modal_data" not in own
    # media_as_text off: the multimodal path, decoded
    off = render(renderer, content_of(data), as_text=False)
    assert len(decodes) == 4 and off["multi_modal_data"]["image"]


def test_an_image_the_index_lacks_takes_the_full_path(renderer, store_codes, decodes):
    known, decode = renderer.known_images, decode_settings(renderer)
    unknown = png_bytes(3)  # codes not stored: the multimodal path
    got = render(renderer, content_of(unknown))
    assert len(decodes) == 1 and len(got["multi_modal_data"]["image"]) == 1
    # its bytes are indexed (the engine stores its codes; the next request then takes the shortcut)
    entry = known.indexed(unknown, decode)
    assert entry is not None and known.known_bytes(unknown, decode) is None
    again = render(renderer, content_of(unknown))
    assert len(decodes) == 2 and again["multi_modal_data"]["image"], "an image without codes left the request"
    # a data URL that is not base64 or not an image: vLLM's own answer, unchanged
    with pytest.raises(ValueError):
        render(renderer, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])


def test_a_moved_index_entry_is_a_miss_and_is_written_again(renderer, store_codes, decodes):
    from vllm_model.known_media import raw_key

    known, decode = renderer.known_images, decode_settings(renderer)
    store = known.cache.store
    a, b = png_bytes(4), png_bytes(5)  # same size: a's codes would fit b's prompt
    store_codes(a)
    store_codes(b)
    want_a = render(renderer, content_of(a))
    want_b = render(renderer, content_of(b))
    assert want_a["prompt_token_ids"] != want_b["prompt_token_ids"]
    assert len(decodes) == 2
    fingerprint = known._fingerprint.result()
    path_a, path_b = (store.path(raw_key(x, fingerprint, decode)) for x in (a, b))
    assert path_a.is_file() and path_b.is_file()

    shutil.copyfile(path_a, path_b)  # a's well-formed entry under b's key: b would get a's codes
    corrupt = store.corrupt
    assert known.indexed(b, decode) is None and store.corrupt == corrupt + 1 and not path_b.exists()
    shutil.copyfile(path_a, path_b)
    got = render(renderer, content_of(b))
    assert len(decodes) == 3, "b was not decoded again"
    assert got["prompt_token_ids"] == want_b["prompt_token_ids"], "another image's codes were served"
    assert known.indexed(b, decode)[0] != known.indexed(a, decode)[0]
    again = render(renderer, content_of(b))  # the rewritten entry serves b
    assert len(decodes) == 3 and again["prompt_token_ids"] == want_b["prompt_token_ids"]

    # a damaged entry (a flipped byte): a miss, recomputed the same way
    blob = bytearray(path_b.read_bytes())
    blob[-3] ^= 0x01
    path_b.write_bytes(bytes(blob))
    got = render(renderer, content_of(b))
    assert len(decodes) == 4 and got["prompt_token_ids"] == want_b["prompt_token_ids"]


def test_index_payloads_are_checked():
    from vllm_model.known_media import _index_entry, _index_payload

    key = "ab" * 32
    assert _index_entry(_index_payload(key, (3, 4))) == (key, (3, 4))
    for bad in (None, b"", b"junk", _index_payload("AB" * 32, (3, 4)), _index_payload("ab" * 31, (3, 4)),
                _index_payload(key, (0, 4)), _index_payload(key, (3, -1)),
                _index_payload(key, (3, 4))[:-1], _index_payload(key, (3, 4)).replace(b"[3, 4]", b"[3.0, 4]")):
        assert _index_entry(bad) is None, bad


def test_parts_the_index_does_not_take_keep_vllms_meaning(renderer, store_codes, decodes):
    data = png_bytes(6)
    store_codes(data)
    render(renderer, content_of(data))  # indexed
    assert len(decodes) == 1
    # the client's own uuid: vLLM's meaning (its processor cache's key), decoded as before
    own = render(renderer, [{"type": "image_url", "image_url": {"url": url_of(data)}, "uuid": "mine"}])
    assert len(decodes) == 2 and "multi_modal_data" not in own  # found by its pixels
    # a part that is not a data URL of an image, next to one that is: each takes its own path
    with pytest.raises(ValueError):
        render(renderer, [*content_of(data), {"type": "image_url", "image_url": {"url": "data:text/plain,hi"}}])
    mixed = render(renderer, [*content_of(data), {"type": "text", "text": "and"}, *content_of(png_bytes(7))[1:]])
    assert len(decodes) == 3 and len(mixed["multi_modal_data"]["image"]) == 1  # only the unknown one
