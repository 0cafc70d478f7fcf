"""Parity with the released ``transformers`` port on the same checkpoint and multimodal prompt.

The reference environment (transformers 5.24) writes the expected greedy tokens, their
log-probabilities and the media codes into ``$APERTUS_EXCHANGE``; this test compares them with
what the vLLM server (float32) returns and with the codes its model embedded
(``APERTUS_VLLM_CODES_LOG``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA

from apertus_plugins.media import audio as media_audio
from apertus_plugins.serve import http_json

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def test_greedy_tokens_logprobs_and_codes_match_the_port(server, checkpoint, codes_log, image_part, audio_part):
    exchange = Path(os.environ.get("APERTUS_EXCHANGE", checkpoint.parent)) / "vllm-parity"
    exchange.mkdir(parents=True, exist_ok=True)
    reference = os.environ.get("APERTUS_PYTHON_REFERENCE")
    assert reference, "APERTUS_PYTHON_REFERENCE is not set (tests/vllm/needs.txt lists the reference suite)"

    before = len(codes_log.read_text().splitlines()) if codes_log.exists() else 0
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look and listen: "}, image_part, audio_part]}]
    status, body = http_json(server.url("/v1/chat/completions"), {
        "model": "apertus", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
        "return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False}, timeout=600)
    assert status == 200, body
    choice = body["choices"][0]
    got_tokens = choice["token_ids"]
    got_logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    embedded = [json.loads(line) for line in codes_log.read_text().splitlines()[before:]]

    wave, rate = media_audio.load_audio(DATA / "demo.wav")
    np.save(exchange / "clip24k.npy", media_audio.preprocess_audio(wave, rate))
    request = {"checkpoint": str(checkpoint), "prompt_ids": body["prompt_token_ids"], "image": str(DATA / "demo.png"),
               "audio": str(exchange / "clip24k.npy"), "tokens": got_tokens}
    (exchange / "request.json").write_text(json.dumps(request))
    script = Path(__file__).with_name("reference_parity.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([reference, str(script), str(exchange / "request.json"), str(exchange / "expected.json")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    want = json.loads((exchange / "expected.json").read_text())

    assert [c["codes"] for c in embedded if c["modality"] == "image"] == want["image_codes"]
    assert [c["codes"] for c in embedded if c["modality"] == "audio"] == want["audio_codes"]
    # greedy agreement: the port picks vLLM's token at every step (or stands at a near-tie, margin < 1e-3)
    for step, (mine, theirs, margin) in enumerate(zip(got_tokens, want["tokens"], want["margins"], strict=True)):
        assert mine == theirs or margin < 1e-3, f"step {step}: vLLM {mine}, port {theirs} (margin {margin:.2e})"
    diffs = np.abs(np.asarray(got_logprobs) - np.asarray(want["logprobs"]))
    assert diffs.max() <= 1e-3, f"log-probability differences {diffs.tolist()}"
