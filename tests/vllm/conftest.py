"""Session fixtures of the vllm suite: one tiny checkpoint, the suite's real server on loopback (and the
misconfigured one), both started together."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "apertus_plugins" / "assets"
MEDIA_LIMIT = {"image": 2, "audio": 2}


@pytest.fixture(scope="session")
def checkpoint(apertus_tiny_checkpoint: Path) -> Path:
    """The ``apertus`` pytest plugin's tiny random checkpoint (released layout, every tensor shaping the output)."""
    return apertus_tiny_checkpoint


@pytest.fixture(scope="session")
def codes_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("codes") / "codes.jsonl"


def server_args(one_process: bool = True) -> list[str]:
    """The flags of the suite's server (:func:`server`); other servers add theirs to these. ``one_process``: the
    model in the engine core's process (:data:`ONE_PROCESS_ARGS`, 10 s less per start); the suite's server and
    the server with two API server processes keep vLLM's CPU default, a worker process of its own."""
    import json

    return [*CPU_ARGS, *(ONE_PROCESS_ARGS if one_process else ()), "--dtype", "float32", "--served-model-name", "apertus",
            "--enable-auto-tool-choice", "--tool-call-parser", "apertus", "--reasoning-parser", "apertus",
            "--limit-mm-per-prompt", json.dumps(MEDIA_LIMIT), "--max-num-seqs", "16",
            "--structured-outputs-config", json.dumps({"enable_in_reasoning": True})]


def _suite_server(name: str, checkpoint: Path, codes_log: Path, tmp_path_factory) -> VLLMServer:
    """The suite's two session servers (launched, not waited for): ``server`` and ``training_server``."""
    import json

    if name == "server":
        log = tmp_path_factory.mktemp("logs") / "vllm-server.log"
        env = {"APERTUS_VLLM_CODES_LOG": str(codes_log), "VLLM_CPU_KVCACHE_SPACE": "1"}
        return VLLMServer(checkpoint, args=server_args(one_process=False), env=env, log_path=log,
                         startup_timeout=900).launch()
    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", "apertus", "--tokenizer-mode", "hf",
            "--mm-processor-kwargs", json.dumps({"image_layout": "training"}),
            "--limit-mm-per-prompt", json.dumps({"image": 1, "audio": 1})]
    log = tmp_path_factory.mktemp("logs") / "vllm-training.log"
    return VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900).launch()


@pytest.fixture(scope="session")
def _session_servers(request, checkpoint, codes_log, tmp_path_factory):
    """The session servers the collected tests use, launched together when the first is needed: their starts
    overlap (each is mostly one process importing at a time, on two cores) instead of following each other.
    Each lives to the end of the session, as it would if started on first use."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    servers: dict[str, VLLMServer] = {}
    try:
        for name in ("server", "training_server"):
            if name in used:
                servers[name] = _suite_server(name, checkpoint, codes_log, tmp_path_factory)
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def _ready(servers: dict[str, VLLMServer], name: str, checkpoint: Path, codes_log: Path,
           tmp_path_factory) -> VLLMServer:
    if name not in servers:  # asked for by a test pytest did not see use it (getfixturevalue)
        servers[name] = _suite_server(name, checkpoint, codes_log, tmp_path_factory)
    return servers[name].wait_ready()


@pytest.fixture(scope="session")
def server(_session_servers, checkpoint, codes_log, tmp_path_factory):
    """The one server of the suite: float32, both parsers, at most two images and two clips per prompt;
    structured outputs hold from the first token, the thinking span included (the tests force outputs)."""
    return _ready(_session_servers, "server", checkpoint, codes_log, tmp_path_factory)


@pytest.fixture(scope="session")
def training_server(_session_servers, checkpoint, codes_log, tmp_path_factory):
    """The misconfigured server: the training image layout, at most one image and one clip per prompt,
    neither the tool nor the reasoning parser, and vLLM's stock chat path (``--tokenizer-mode hf``:
    the template rendered and tokenized whole, not injection-safe); the doctor must flag all of it."""
    return _ready(_session_servers, "training_server", checkpoint, codes_log, tmp_path_factory)


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
