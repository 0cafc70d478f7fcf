"""Image prompts in RL: verl's record layout, the pre-run checks, and the prompt ids of the rollout.

A parquet in verl's multimodal layout (``images`` with file bytes or paths, ``<image>`` markers or image parts)
is read by :class:`verl_ext.dataset.ApertusRLDataset`: a record whose image cannot be decoded or is above the
media limits, or whose prompt is longer than ``data.max_prompt_length``, is dropped before the run with its
id named and counted. The Apertus agent loop turns the kept image prompts into prompt ids with the images'
codes in place: the core's encoding with the checkpoint's vision tokenizer (``encoders.image_ids``, the
released processor's inference layout), and what the served model (vLLM with the plugin, the suite's server)
builds for the same conversation sent as a chat request with the image.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import numpy as np
import pytest

from apertus_plugins.infra.client import http_json


def png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def claimed_size_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (its pixel data is a 1 x 1 image's): refused from the header."""
    data = bytearray(png(1, 1))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    return bytes(data)


def records(tmp_path) -> list[dict]:
    path_image = tmp_path / "photo.png"
    path_image.write_bytes(png(40, 24, seed=2))
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return [
        {"id": "text", "prompt": user("What is 2 + 2?"), "images": None},
        {"id": "marker-bytes", "prompt": user("<image>How many red squares?"),
         "images": [{"bytes": png(32, 32, seed=1), "path": None}]},
        {"id": "parts-path", "prompt": user("Compare <image> and <image>"),
         "images": [{"bytes": None, "path": str(path_image)}, {"bytes": png(16, 16), "path": None}]},
        {"id": "corrupt", "prompt": user("<image>What is this?"), "images": [{"bytes": b"\x89PNG\r\n\x1a\nnot a png",
                                                                               "path": None}]},
        {"id": "truncated", "prompt": user("<image>And this?"), "images": [{"bytes": png(64, 64)[:200], "path": None}]},
        {"id": "huge", "prompt": user("<image>Describe."), "images": [{"bytes": claimed_size_png(9000, 9000),
                                                                        "path": None}]},
        {"id": "missing-file", "prompt": user("<image>Describe."), "images": [{"bytes": None,
                                                                                "path": str(tmp_path / "nope.png")}]},
        {"id": "marker-count", "prompt": user("<image><image>Two?"), "images": [{"bytes": png(8, 8), "path": None}]},
        {"id": "overlong", "prompt": user("word " * 400), "images": None},
    ]


def write_parquet(path, rows) -> str:
    import pandas as pd

    pd.DataFrame([{"data_source": "exact_match", "prompt": r["prompt"], "images": r["images"],
                   "reward_model": {"style": "rule", "ground_truth": "4"},
                   "extra_info": {"index": r["id"]}} for r in rows]).to_parquet(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset(apertus_checkpoint, tmp_path_factory):
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer

    from verl_ext.dataset import ApertusRLDataset

    work = tmp_path_factory.mktemp("rl-images")
    rows = records(work)
    config = OmegaConf.create({"max_prompt_length": 512, "filter_overlong_prompts": True, "image_key": "images",
                               "cache_dir": str(work / "cache"), "filter_overlong_prompts_workers": 2,
                               "apply_chat_template_kwargs": {"enable_thinking": False}})
    ds = ApertusRLDataset(write_parquet(work / "rl.parquet", rows), hf_tokenizer(str(apertus_checkpoint)), config)
    return ds, rows


def test_bad_images_and_overlong_prompts_are_dropped_before_the_run_by_id(dataset, capsys):
    ds, _rows = dataset
    report = ds.drop_report
    assert report.total == 9 and report.kept == 3 == len(ds)
    dropped = {reason: [rid for rid, _ in items] for reason, items in report.dropped.items()}
    assert sorted(dropped["image"]) == ["corrupt", "huge", "missing-file", "truncated"]
    assert dropped["format"] == ["marker-count"] and dropped["overlong"] == ["overlong"]
    why = dict(report.dropped["image"] + report.dropped["format"] + report.dropped["overlong"])
    assert "not a readable image" in why["corrupt"] and "image 0" in why["corrupt"]
    assert "81000000" in why["huge"].replace(",", "") or "pixels" in why["huge"]
    assert "no such image file" in why["missing-file"]
    assert "2 image places but the record has 1 images" in why["marker-count"]
    assert why["overlong"].endswith("tokens") and int(why["overlong"].split()[0]) > 512
    assert [ds[k]["extra_info"]["index"] for k in range(len(ds))] == ["text", "marker-bytes", "parts-path"]
    # content parts work as the markers do (a parquet column holds one form: strings here)
    from verl_ext.dataset import prompt_messages

    parts = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": None},
                                          {"type": "text", "text": " and "}, {"type": "image"}]}]
    assert prompt_messages(parts, 2, "x") == ds[2]["raw_prompt"]
    with pytest.raises(ValueError, match="x: the prompt has 2 image places but the record has 1 images"):
        prompt_messages(parts, 1, "x")
    assert report.summary(512).startswith("apertus RL prompts: 3 of 9 kept; dropped 1 longer than 512 tokens, "
                                          "4 with an unreadable or oversized image, 1 the chat format cannot render")


def _agent_loop(checkpoint):
    import hydra
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils import hf_tokenizer

    import verl_ext.plugin  # noqa: F401  (registers apertus_single_turn)
    from verl_ext.dataset import ApertusRLDataset

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        cfg = compose(config_name="apertus_rlvr", overrides=[f"actor_rollout_ref.model.path={checkpoint}"])
    return hydra.utils.instantiate(config=_agent_loop_registry["apertus_single_turn"],
                                   trainer_config=DictConfigWrap(config=cfg), server_manager=None,
                                   tokenizer=hf_tokenizer(str(checkpoint)), processor=None, hf_model_type="apertus1p5",
                                   dataset_cls=ApertusRLDataset, data_config=DictConfigWrap(cfg.data),
                                   tools=ToolListWrap([]))


def rollout_prompt_ids(checkpoint, row: dict) -> list[int]:
    """The prompt ids the agent loop's ``run`` sends to the rollout engine for a dataset row."""
    from verl_ext.dataset import MEDIA_FIELD

    loop = _agent_loop(checkpoint)
    loop.use_sample(**row)
    run = loop.loop.run_until_complete
    run(loop.use_images(row[MEDIA_FIELD]))
    assert run(loop.process_multi_modal_info(row["raw_prompt"])) == {}  # nothing but ids for the engine
    return run(loop.ct_build_initial_tokens(list(row["raw_prompt"])))


def test_image_prompt_ids_are_the_core_encoding_with_the_images_codes(dataset, apertus_checkpoint, chat_tokenizer):
    from apertus_plugins.core.chat import MediaItem
    from apertus_plugins.core.media import image as media_image
    from apertus_plugins.encoders import image_ids, load_vision_tokenizer

    ds, rows = dataset
    vision = load_vision_tokenizer(apertus_checkpoint)
    spec = chat_tokenizer.spec
    image = spec.modality("image")
    for k, rid in enumerate(["text", "marker-bytes", "parts-path"]):
        row = ds[k]
        got = rollout_prompt_ids(apertus_checkpoint, row)
        (src,) = [r for r in rows if r["id"] == rid]
        images = [im["bytes"] if im["bytes"] else im["path"] for im in (src["images"] or [])]
        media = [MediaItem("image", image_ids(vision, im, spec, "inference", chat_tokenizer.text_ids)) for im in images]
        messages = [{"role": "user", "content": row["raw_prompt"][0]["content"]}]
        want = chat_tokenizer.encode_conversation(messages, add_generation_prompt=True, media=media or None).ids
        assert got == [int(i) for i in want], rid
        codes = [i for i in got if image.offset <= i < image.end]
        assert len(codes) == sum(int(np.prod(media_image.image_grid(*_hw(im)))) for im in images), rid
        if images:
            assert media_image.detect_image_layout(got, spec) == "inference"


def _hw(src) -> tuple[int, int]:
    from apertus_plugins.core.media import image as media_image

    img = media_image.open_image(src)
    return img.height, img.width


def test_served_model_builds_the_same_prompt_for_the_chat_request_with_the_image(dataset, judge_server,
                                                                                 chat_tokenizer):
    """The server's prompt for the chat request with the image is the rollout's prompt, position by position
    (the server reports the placeholder id where the engine puts the image's codes); the engine's continuation
    of the rollout's ids (codes in the prompt) is its continuation of the chat request: the same inputs."""
    ds, _rows = dataset
    row = ds[1]  # "marker-bytes": <image> then text
    ids = rollout_prompt_ids(judge_server.checkpoint, row)
    spec = chat_tokenizer.spec
    image = spec.modality("image")
    url = "data:image/png;base64," + base64.b64encode(row["apertus_images"][0]).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "How many red squares?"}]
    chat = _post(judge_server.url + "/chat/completions", {
        "model": judge_server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
        "temperature": 0, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    served = chat["prompt_token_ids"]
    as_placeholder = [spec.id("image") if image.offset <= i < image.end else i for i in ids]
    assert served == as_placeholder
    direct = _post(judge_server.url + "/completions", {
        "model": judge_server.model, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 1,
        "return_token_ids": True})
    assert direct["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    got = direct["choices"][0]["logprobs"]["token_logprobs"]
    want = [t["logprob"] for t in chat["choices"][0]["logprobs"]["content"]]
    assert np.allclose(got, want, atol=1e-4), (got, want)


def _post(url: str, payload: dict) -> dict:
    status, body = http_json(url, payload, timeout=300)
    assert status == 200, (status, body)
    return body


def test_images_are_decoded_off_the_event_loop(dataset, apertus_checkpoint):
    """``use_images`` runs the decoding and the vision tokenizer in an executor: the loop stays responsive."""
    ds, _rows = dataset
    loop = _agent_loop(apertus_checkpoint)
    ticks = []

    async def ticker():
        for _ in range(3):
            ticks.append(1)
            await asyncio.sleep(0)

    async def both():
        await asyncio.gather(loop.use_images(ds[2]["apertus_images"]), ticker())

    loop.loop.run_until_complete(both())
    assert len(ticks) == 3 and len(loop.continuous_token_builder.media) == 2
