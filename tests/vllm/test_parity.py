"""Parity with the released ``transformers`` port on the same checkpoint and multimodal prompt.

The vLLM server (float32) answers one chat request with text, an image and an audio clip: its
prompt ids and per-position prompt log-probabilities, its greedy tokens and their log-probabilities.
The reference environment (transformers 5.24) runs the port on the same prompt ids and media and
writes, into ``$APERTUS_EXCHANGE``, its own log-probabilities over the prompt, its own greedy
decoding and the media codes; this test compares them: the same tokens, log-probabilities within
1e-3, and the codes the model embedded (``APERTUS_VLLM_CODES_LOG``) equal to the port's. The
checkpoint is the ``varied`` initialization, so top-2 margins stand far above float32 noise and a
wrong norm or activation parameter moves the numbers past the tolerance (xIELU alphas rounded to
bfloat16, as vLLM's own Apertus layer keeps them, move a prompt log-probability by 1e-2).
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import data_url

from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.infra.client import http_json

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
TOLERANCE = 1e-3


def write_media(folder: Path) -> tuple[Path, Path]:
    """An image and a clip no other test sends (so vLLM encodes them here, not from its caches).

    A textured 72x52 RGB image (resized by the processor) and 0.3 s of a tone in noise at 22.05 kHz
    stereo (resampled to 24 kHz and downmixed by the core).
    """
    import soundfile
    from PIL import Image

    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:52, 0:72]
    pattern = np.stack([(x * 3) % 256, (y * 5) % 256, (x * y) % 256], axis=-1)
    pixels = np.clip(pattern + rng.integers(-40, 40, pattern.shape), 0, 255).astype(np.uint8)
    image = folder / "parity.png"
    Image.fromarray(pixels).save(image)
    t = np.arange(int(0.3 * 22050)) / 22050
    tone = 0.4 * np.sin(2 * np.pi * 330 * t)
    wave = np.stack([tone + 0.05 * rng.standard_normal(t.size), 0.5 * tone], axis=-1).astype(np.float32)
    clip = folder / "parity.wav"
    soundfile.write(clip, wave, 22050)
    return image, clip


def test_greedy_tokens_logprobs_and_codes_match_the_port(server, checkpoint, codes_log):
    exchange = Path(os.environ.get("APERTUS_EXCHANGE", checkpoint.parent)) / "vllm-parity"
    exchange.mkdir(parents=True, exist_ok=True)
    reference = os.environ.get("APERTUS_PYTHON_REFERENCE")
    assert reference, "APERTUS_PYTHON_REFERENCE is not set (tests/vllm/needs.txt lists the reference suite)"
    image, clip = write_media(exchange)

    before = len(codes_log.read_text().splitlines()) if codes_log.exists() else 0
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Parity: look and listen. "},
        {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.read_bytes()).decode(), "format": "wav"}},
    ]}]
    status, body = http_json(server.url("/v1/chat/completions"), {
        "model": "apertus", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
        "prompt_logprobs": 1, "return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False},
        timeout=600)
    assert status == 200, body
    choice = body["choices"][0]
    prompt = body["prompt_token_ids"]
    got_tokens = choice["token_ids"]
    got_logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    got_prompt = [None if entry is None else entry[str(tok)]["logprob"]
                  for entry, tok in zip(body["prompt_logprobs"], prompt, strict=True)][1:]
    embedded = [json.loads(line) for line in codes_log.read_text().splitlines()[before:]]

    wave, rate = media_audio.load_audio(clip)
    np.save(exchange / "clip24k.npy", media_audio.preprocess_audio(wave, rate))
    request = {"checkpoint": str(checkpoint), "prompt_ids": prompt, "image": str(image),
               "audio": str(exchange / "clip24k.npy"), "max_tokens": MAX_TOKENS}
    (exchange / "request.json").write_text(json.dumps(request))
    script = Path(__file__).with_name("reference_parity.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([reference, str(script), str(exchange / "request.json"), str(exchange / "expected.json")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    want = json.loads((exchange / "expected.json").read_text())
    (exchange / "got.json").write_text(json.dumps({"prompt_logprobs": got_prompt, "tokens": got_tokens,
                                                   "logprobs": got_logprobs}))

    # the media codes vLLM embedded are the port's
    assert [c["codes"] for c in embedded if c["modality"] == "image"] == want["image_codes"]
    assert [c["codes"] for c in embedded if c["modality"] == "audio"] == want["audio_codes"]

    # prefill: every prompt position whose next id the head scores; media ids are impossible outputs
    scored = [(i, g, w) for i, (g, w) in enumerate(zip(got_prompt, want["prompt_logprobs"], strict=True))
              if w is not None]
    assert len(scored) > 20
    worst = max(scored, key=lambda x: abs(x[1] - x[2]))
    assert abs(worst[1] - worst[2]) <= TOLERANCE, f"prompt position {worst[0] + 1}: vLLM {worst[1]}, port {worst[2]}"
    for i, (g, w) in enumerate(zip(got_prompt, want["prompt_logprobs"], strict=True)):
        if w is None:
            assert g is not None and (g <= -9999.0 or math.isinf(g)), f"prompt position {i + 1}: media id scored {g}"

    # decode: the port's own greedy tokens (no forcing) and their log-probabilities
    assert got_tokens == want["tokens"], (f"greedy tokens differ: vLLM {got_tokens}, port {want['tokens']} "
                                          f"(port top-2 margins {want['margins']})")
    diffs = np.abs(np.asarray(got_logprobs) - np.asarray(want["logprobs"]))
    assert diffs.max() <= TOLERANCE, f"log-probability differences {diffs.tolist()}"
