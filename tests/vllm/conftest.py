"""Session fixtures of the vllm suite: one tiny checkpoint, one real server on loopback."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "apertus_plugins" / "assets"
MEDIA_LIMIT = {"image": 2, "audio": 2}


@pytest.fixture(scope="session")
def checkpoint(apertus_tiny_checkpoint: Path) -> Path:
    """The ``apertus`` pytest plugin's tiny random checkpoint (released layout, every tensor shaping the output)."""
    return apertus_tiny_checkpoint


@pytest.fixture(scope="session")
def codes_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("codes") / "codes.jsonl"


def server_args() -> list[str]:
    """The flags of the suite's server (:func:`server`); other servers add theirs to these."""
    import json

    return [*CPU_ARGS, "--dtype", "float32", "--served-model-name", "apertus",
            "--enable-auto-tool-choice", "--tool-call-parser", "apertus", "--reasoning-parser", "apertus",
            "--limit-mm-per-prompt", json.dumps(MEDIA_LIMIT), "--max-num-seqs", "16",
            "--structured-outputs-config", json.dumps({"enable_in_reasoning": True})]


@pytest.fixture(scope="session")
def server(checkpoint, codes_log, tmp_path_factory):
    """The one server of the suite: float32, both parsers, at most two images and two clips per prompt;
    structured outputs hold from the first token, the thinking span included (the tests force outputs)."""
    log = tmp_path_factory.mktemp("logs") / "vllm-server.log"
    env = {"APERTUS_VLLM_CODES_LOG": str(codes_log), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with VLLMServer(checkpoint, args=server_args(), env=env, log_path=log, startup_timeout=900) as srv:
        yield srv


@pytest.fixture(scope="session")
def training_server(checkpoint, tmp_path_factory):
    """The misconfigured server: the training image layout, at most one image and one clip per prompt,
    neither the tool nor the reasoning parser, and vLLM's stock chat path (``--tokenizer-mode hf``:
    the template rendered and tokenized whole, not injection-safe); the doctor must flag all of it."""
    import json

    args = [*CPU_ARGS, "--dtype", "float32", "--served-model-name", "apertus", "--tokenizer-mode", "hf",
            "--mm-processor-kwargs", json.dumps({"image_layout": "training"}),
            "--limit-mm-per-prompt", json.dumps({"image": 1, "audio": 1})]
    log = tmp_path_factory.mktemp("logs") / "vllm-training.log"
    with VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900) as srv:
        yield srv


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="session")
def image_part(apertus_image_part: dict) -> dict:
    return apertus_image_part


@pytest.fixture(scope="session")
def audio_part(apertus_audio_part: dict) -> dict:
    return apertus_audio_part


def pytest_report_header(config):
    return f"vllm suite: APERTUS_PYTHON_VLLM={os.environ.get('APERTUS_PYTHON_VLLM')}"
