"""The lmms-eval model wrapper and the wrapped image and audio tasks in the real lmms-eval harness."""

from __future__ import annotations

import base64
import glob
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from apertus_plugins.cli.eval_path import include_path
from apertus_plugins.evaluation import AUDIO_SAMPLE_RATE, LONG_FORM_ASR_MAX_TOKENS, stop_strings
from apertus_plugins.serve import VLLMServer, free_port

LMMS = include_path("lmms_eval")
IMAGE_TASKS = ["apertus_chartqa", "apertus_ai2d", "apertus_docvqa_val", "apertus_gqa"]
AUDIO_TASKS = ["apertus_librispeech_test_clean", "apertus_fleurs_en", "apertus_tedlium_long_form",
               "apertus_vocalsound_test"]


def _model(**kwargs):
    from eval_tasks.lmms_model import Apertus

    return Apertus(base_url="http://127.0.0.1:9/v1", model="m", **kwargs)


def _tasks(names: list[str]) -> dict:
    from lmms_eval.tasks import TaskManager, get_task_dict

    return get_task_dict(names, TaskManager(include_path=str(LMMS), include_defaults=False), "simple")


def test_the_model_is_registered_through_the_entry_point() -> None:
    from lmms_eval.models import get_model

    from eval_tasks.lmms_model import Apertus

    assert get_model("apertus") is Apertus


def test_image_and_audio_parts() -> None:
    import soundfile as sf
    from PIL import Image

    from eval_tasks.lmms_model import audio_part, image_part

    img = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    url = image_part(img)["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    back = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert np.array_equal(np.asarray(back), np.asarray(img))

    stereo = np.stack([np.sin(np.arange(6400) / 7.0), np.zeros(6400)], axis=1).astype(np.float32)
    part = audio_part({"array": stereo, "sampling_rate": 16000})
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    wave, rate = sf.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])))
    assert rate == AUDIO_SAMPLE_RATE == 24000 and wave.ndim == 1 and len(wave) == 9600  # 0.4 s at 24 kHz
    assert np.max(np.abs(wave)) == pytest.approx(10 ** (-3 / 20), rel=1e-4)  # the model's peak normalization


def test_payload_honours_task_stops_caps_and_the_thinking_flag() -> None:
    from PIL import Image

    model = _model()
    img = Image.new("RGB", (8, 8))
    body = model.payload("What is shown?", [img], {"until": ["\n\n"], "max_new_tokens": 64, "temperature": 0})
    assert body["model"] == "m" and body["max_tokens"] == 64 and body["temperature"] == 0.0
    assert body["stop"] == ["\n\n", *stop_strings()]
    assert body["skip_special_tokens"] is False and body["chat_template_kwargs"] == {"enable_thinking": False}
    content = body["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"] and content[1]["text"] == "What is shown?"
    assert "top_p" not in body
    # no task cap: the protocol's budget; a model cap replaces the task's
    assert model.payload("q", [], {})["max_tokens"] == 16384
    assert _model(max_new_tokens="8").payload("q", [], {"max_new_tokens": 64})["max_tokens"] == 8
    thinking = _model(enable_thinking="true").payload("q", [], {"max_new_tokens": 64, "temperature": 0})
    assert thinking["chat_template_kwargs"] == {"enable_thinking": True}
    assert thinking["temperature"] == 0.6 and thinking["top_p"] == 0.95
    with pytest.raises(TypeError, match="images and audio"):
        model.payload("q", [object()], {})


def test_answers_lose_the_thinking_span() -> None:
    def reply(text: str) -> dict:
        return {"choices": [{"message": {"content": text}}]}

    assert _model()._answer(reply("<think>hmm</think> 42")) == "42"
    assert _model()._answer(reply("<|inner_prefix|>hmm<|inner_suffix|>B")) == "B"
    assert _model()._answer(reply("<think>ran out of tokens")) == ""
    assert _model(strip_thinking="false")._answer(reply("<think>x</think>y")) == "<think>x</think>y"


def test_an_unreachable_server_is_a_clear_error() -> None:
    from eval_tasks.lmms_model import Apertus, ServerUnreachable

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerUnreachable, match=r"no server answers at .*/v1/models \(model_args base_url="):
        Apertus(base_url=url)
    model = Apertus(base_url=url, model="m", max_retries=1, timeout=5)
    with pytest.raises(ServerUnreachable, match=r"request to .*/chat/completions \(model m\) failed after 1"):
        model._post(model.payload("q", [], {}))


def test_wrapped_tasks_read_local_images_and_audio(data_env: Path) -> None:
    from PIL import Image

    tasks = _tasks(IMAGE_TASKS + AUDIO_TASKS)
    model = _model()
    for name in IMAGE_TASKS + AUDIO_TASKS:
        task = tasks[name]
        assert task.config.task == name
        docs = list(task.test_docs())
        assert docs, name
        visuals = task.doc_to_visual(docs[0])
        if name in IMAGE_TASKS:
            assert all(isinstance(v, Image.Image) for v in visuals), name
        else:
            assert len(visuals) == 1 and visuals[0]["path"].endswith(".wav"), name  # undecoded
        body = model.payload(task.doc_to_text(docs[0]), visuals, task.config.generation_kwargs)
        kinds = [p["type"] for p in body["messages"][0]["content"]]
        assert kinds == ["image_url" if name in IMAGE_TASKS else "input_audio", "text"], name
        cap = LONG_FORM_ASR_MAX_TOKENS if name == "apertus_tedlium_long_form" else 16384
        assert body["max_tokens"] == cap, name
    # GQA found its image in the local images configuration
    assert tasks["apertus_gqa"].test_docs()[0]["image"].size == (56, 40)


def test_ai2d_scores_prose_answers() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_utils", LMMS / "image" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    doc = {"options": ["fox", "grass", "hawk"], "answer": "1"}
    for reply, score in [("B", 1.0), ("The producer is grass.", 1.0), ("B. grass", 1.0), ("The answer is (C)", 0.0),
                         ("It could be a fox or a hawk.", 0.0)]:
        assert utils.ai2d_process_results(doc, [reply]) == {"exact_match": score}, reply


def test_every_wrapped_task_names_an_existing_upstream_task() -> None:
    from eval_tasks.lmms_eval.common import upstream_config

    for path in sorted(LMMS.rglob("apertus_*.yaml")):
        cfg = yaml.safe_load(path.read_text().replace("!function ", ""))
        assert cfg["task"] == path.stem
        base = upstream_config(cfg["upstream"])
        assert base.get("output_type", "generate_until") == "generate_until"
        assert cfg["apertus_data"]["key"]
        assert cfg["generation_kwargs"]["max_new_tokens"] in (16384, LONG_FORM_ASR_MAX_TOKENS)


def test_missing_local_data_names_the_task_and_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eval_tasks.data import DataPathError

    monkeypatch.setenv("APERTUS_EVAL_DATA_CHARTQA", str(tmp_path / "missing"))
    with pytest.raises(DataPathError, match=r"task apertus_chartqa: the data path .*missing given by "
                                            r"APERTUS_EVAL_DATA_CHARTQA does not exist"):
        _tasks(["apertus_chartqa"])


TEXT_ONLY_TASK = """\
# ChartQA's documents and scoring through the apertus model, without the image (a text-only model
# serves the suite until the multimodal plugin lands)
task: apertus_test_chartqa_text
class: !function utils.ApertusTask
upstream: chartqa/chartqa.yaml
doc_to_visual: !function utils.no_visual
apertus_data:
  key: chartqa
  images: [image]
generation_kwargs:
  max_new_tokens: 16384
  temperature: 0
  do_sample: false
  until: ["\\n\\n"]
"""


def test_lmms_eval_runs_a_task_end_to_end(vllm_server: VLLMServer, data_env: Path, tmp_path: Path) -> None:
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "apertus_test_chartqa_text.yaml").write_text(TEXT_ONLY_TASK)
    (tasks_dir / "utils.py").write_text("from eval_tasks.lmms_eval.common import ApertusTask  # noqa: F401\n\n\n"
                                        "def no_visual(doc):\n    return []\n")
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "apertus",
           "--model_args", f"base_url={vllm_server.base_url},max_new_tokens=8",
           "--tasks", "apertus_test_chartqa_text", "--include_path", str(tasks_dir),
           "--output_path", str(tmp_path / "out"), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = glob.glob(str(tmp_path / "out" / "**" / "*results*.json"), recursive=True)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(Path(found[0]).read_text())["results"]["apertus_test_chartqa_text"]
    assert "relaxed_overall,none" in results and 0.0 <= results["relaxed_overall,none"] <= 1.0
    samples = glob.glob(str(tmp_path / "out" / "**" / "*apertus_test_chartqa_text*.jsonl"), recursive=True)
    rows = [json.loads(x) for x in Path(samples[0]).read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(r["filtered_resps"], str) for r in rows)
    assert rows[0]["input"] == "What is the highest bar?\nAnswer the question with a single word."
