"""Shared fixtures of the eval suite: one served tiny Apertus checkpoint for the whole suite, local datasets.

The model is the project's tiny random Apertus 1.5 checkpoint (``write_checkpoint(size="tiny",
init="varied")``: the released tensor names and id layout, the vision and audio tokenizers, the
tokenizer with the chat template) served by the Apertus vLLM plugin with its tool-call and
reasoning parsers, as a deployment would serve it. The server is also the charter-alignment
judge, so it returns as many log-probabilities as the model has output rows. It appends every
embedded image's and clip's codes to :func:`codes_log` (``APERTUS_VLLM_CODES_LOG``) and logs each
request's sampling parameters (``--enable-log-requests``), so the tests can check what reached it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

sys.path.insert(0, str(Path(__file__).parent))
from _fixtures import write_text_fixtures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "apertus-tiny"
SEED = 0
#: images and clips one request may carry
MEDIA_LIMIT = {"image": 2, "audio": 2}


def vllm_python() -> str:
    python = os.environ.get("APERTUS_PYTHON_VLLM")
    if not python:
        raise RuntimeError("APERTUS_PYTHON_VLLM is not set: run the suite with `python3 tools/dev.py test eval`")
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(apertus_checkpoint_factory) -> Path:
    """The tiny random Apertus 1.5 checkpoint in the released layout (the ``apertus`` pytest plugin's)."""
    return apertus_checkpoint_factory(size="tiny", seed=SEED, init="varied")


def output_rows(model_dir: Path) -> int:
    """The model's output vocabulary (its LM head rows): every rating token is among that many logprobs."""
    from apertus_plugins.testing.checkpoint import read_checkpoint_config

    return int(read_checkpoint_config(model_dir).text["output_vocab_size"])


@pytest.fixture(scope="session")
def judge_top_logprobs(tiny_model_dir: Path) -> int:
    """Alternatives the charter-alignment judge reads: the served model's whole output vocabulary."""
    return output_rows(tiny_model_dir)


@pytest.fixture(scope="session")
def codes_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the server appends the codes of every image and clip it embeds (one JSON line each)."""
    return tmp_path_factory.mktemp("codes") / "codes.jsonl"


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, codes_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The suite's one server: float32 (greedy decoding repeats exactly), both Apertus parsers, two
    images and two clips per prompt, all logprobs (the judge), request logging, the codes log."""
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", SERVED_NAME,
            "--enable-auto-tool-choice", "--tool-call-parser", "apertus", "--reasoning-parser", "apertus",
            "--max-logprobs", str(output_rows(tiny_model_dir)), "--limit-mm-per-prompt", json.dumps(MEDIA_LIMIT),
            "--enable-log-requests"]
    env = {"APERTUS_VLLM_CODES_LOG": str(codes_log), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with VLLMServer(tiny_model_dir, args=args, python=vllm_python(), env=env, log_path=log,
                    startup_timeout=900) as server:
        yield server


@pytest.fixture(scope="session")
def eval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``APERTUS_EVAL_DATA`` folder with every task's small local dataset."""
    from _media_fixtures import write_media_fixtures

    root = tmp_path_factory.mktemp("eval-data")
    write_text_fixtures(root)
    write_media_fixtures(root)
    return root


@pytest.fixture
def data_env(eval_data: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the tasks at the local fixtures (and nowhere else) for one test."""
    for key in [k for k in os.environ if k.startswith("APERTUS_EVAL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("APERTUS_EVAL_DATA", str(eval_data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return eval_data
