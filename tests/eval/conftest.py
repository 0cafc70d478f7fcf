"""Shared fixtures of the eval suite: one tiny served model for the whole suite, local datasets.

The model is a stand-in until the Apertus vLLM plugin and ``apertus make-checkpoint`` land: a
random ``LlamaForCausalLM`` (head dimension 64) with the Apertus test tokenizer and its chat
template, written with the vllm environment's transformers. Switching is the one line of
:data:`MODEL_WRITER`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apertus_plugins.serve import CPU_ARGS, VLLMServer

sys.path.insert(0, str(Path(__file__).parent))
from _fixtures import write_text_fixtures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "apertus-tiny"
#: the tiny vocabulary is 1,032 ids: asking for all of them puts the digits among the alternatives
JUDGE_TOP_LOGPROBS = 1032
#: how the tiny checkpoint is written: (interpreter env var, script arguments before OUT_DIR)
MODEL_WRITER = ("APERTUS_PYTHON_VLLM", [str(Path(__file__).parent / "_tiny_llama.py")])


def vllm_python() -> str:
    python = os.environ.get("APERTUS_PYTHON_VLLM")
    if not python:
        raise RuntimeError("APERTUS_PYTHON_VLLM is not set: run the suite with `python3 tools/dev.py test eval`")
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    env_var, args = MODEL_WRITER
    python = os.environ.get(env_var) or vllm_python()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([python, *args, str(out)], check=True, env=env, cwd=ROOT)
    return out


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    # the model also serves as the charter-alignment judge: all its logprobs may be asked for
    server = VLLMServer(tiny_model_dir, args=[*CPU_ARGS, "--served-model-name", SERVED_NAME,
                                             "--max-logprobs", str(JUDGE_TOP_LOGPROBS)],
                        python=vllm_python(), log_path=log)
    server.start()
    try:
        yield server
    finally:
        server.stop()


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
