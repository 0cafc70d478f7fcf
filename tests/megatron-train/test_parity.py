"""Train-to-serve parity: Megatron's forward of the Apertus spec, the released ``transformers`` port and vLLM agree.

1. The tiny random checkpoint (released layout, ``varied`` weights) goes to Megatron with
   ``apertus convert to-megatron``; Megatron's forward of the Apertus spec on a multimodal prompt
   (an image document and an audio document as ``apertus tokenize pretrain`` wrote them) equals the
   port's logits on the same ids (float32, max abs difference below 1e-4, over the released head).
2. ``apertus-megatron`` finetunes that checkpoint for a few iterations (``--load --finetune``,
   ``--save``); ``apertus convert to-hf --reference RELEASED`` turns the saved checkpoint back into
   the released layout, whose port logits equal Megatron's forward of the saved checkpoint.
3. That converted checkpoint, served by vLLM with the plugin (float32, on loopback), gives the
   greedy tokens Megatron's forward gives, with log-probabilities within 1e-3.

The port runs in the ``reference`` suite's environment, the server in the ``vllm`` suite's
(``tests/megatron-train/needs.txt``); Megatron runs with the CPU harness.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HERE, ROOT, Data, assert_trained, cpu_env, torchrun, train_flags

from apertus_plugins.data.indexed import IndexedDataset

BOUND_LOGITS = 1e-4
BOUND_LOGPROBS = 1e-3
MAX_TOKENS = 6
#: The CPU path of Megatron's model code (local modules, fusions off); the model's shape comes from the checkpoint.
CPU_FLAGS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--use-cpu-initialization"]


def interpreter(suite: str) -> str:
    python = os.environ.get(f"APERTUS_PYTHON_{suite.upper()}")
    assert python, f"APERTUS_PYTHON_{suite.upper()} is not set: run the suite through tools/dev.py (needs.txt)"
    return python


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def megatron_forward(ckpt: Path, request: Path, out: Path) -> dict[str, Any]:
    run([sys.executable, str(HERE / "megatron_forward.py"), str(ckpt), str(request), str(out)],
        env=cpu_env(APERTUS_MEGATRON_CPU_ALL="1"))
    return json.loads(out.read_text())


def port_forward(hf_dir: Path, request: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run([interpreter("reference"), str(HERE / "reference_forward.py"), str(hf_dir), str(request), str(out)], env=env)
    return json.loads(out.read_text())


def apertus(*args: str) -> str:
    return run([sys.executable, "-m", "apertus_plugins.cli", *args])


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def request_file(data: Data, work: Path) -> Path:
    """A multimodal prompt: an image document and an audio document of the tokenized data, codes included."""
    ids = [int(t) for t in np.asarray(IndexedDataset(data.images).get(0))]
    ids += [int(t) for t in np.asarray(IndexedDataset(data.audio).get(0))]
    config = json.loads((data.checkpoint / "config.json").read_text())
    text = config["text_config"]
    assert max(ids) >= config["image_token_offset"] and any(t >= config["audio_token_offset"] for t in ids)
    path = work / "request.json"
    path.write_text(json.dumps({"prompt_ids": ids, "head_rows": text["output_vocab_size"], "max_tokens": MAX_TOKENS}))
    return path


@pytest.fixture(scope="module")
def converted(data: Data, work: Path) -> tuple[Path, list[str]]:
    """``apertus convert to-megatron RELEASED``: the directory and the Megatron flags it prints."""
    out = apertus("convert", "to-megatron", str(data.checkpoint), str(work / "megatron"))
    flags = next(ln for ln in out.splitlines() if ln.startswith("  --num-layers")).split()
    assert "reading checkpoint: 100%" in out  # the progress bar over the shards
    return work / "megatron", flags


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    x, y = np.asarray(a["logits"], dtype=np.float64), np.asarray(b["logits"], dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    return float(np.abs(x - y).max())


def test_megatron_forward_equals_the_port(data: Data, converted: tuple[Path, list[str]], request_file: Path,
                                          work: Path) -> None:
    meg = megatron_forward(converted[0], request_file, work / "megatron-released.json")
    ref = port_forward(data.checkpoint, request_file, work / "port-released.json")
    diff = max_diff(meg, ref)
    print(f"to-megatron: Megatron (Apertus spec) vs transformers port logits, max abs diff {diff:.3e} over "
          f"{len(meg['logits'])} positions x {ref['head_rows']} rows")
    assert diff < BOUND_LOGITS
    assert meg["rope"][0] == "llama3" and meg["rope"][2] == ref["rope"]["factor"]


@pytest.fixture(scope="module")
def trained(data: Data, converted: tuple[Path, list[str]], work: Path) -> Path:
    """A few iterations of ``apertus-megatron`` from the converted checkpoint, saved."""
    ckpt, flags = converted
    save = work / "trained"
    args = [*train_flags(data, iters=3), *CPU_FLAGS, *flags, "--seq-length", "64", "--load", str(ckpt), "--finetune",
            "--save", str(save), "--save-interval", "3", "--data-path", "0.5", data.images, "0.5", data.text,
            "--lr", "1e-2", "--lr-warmup-iters", "0"]
    result = torchrun(args, cwd=work)
    assert_trained(result, 3)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    return save


@pytest.fixture(scope="module")
def trained_hf(data: Data, trained: Path, work: Path) -> Path:
    out = work / "trained-hf"
    log = apertus("convert", "to-hf", str(trained), str(out), "--reference", str(data.checkpoint))
    assert "writing trained-hf: 100%" in log  # the progress bar over the bytes written
    return out


@pytest.fixture(scope="module")
def trained_server(trained_hf: Path, work: Path):
    """vLLM (the vllm suite's environment, with the plugin) serving the trained checkpoint's conversion: launched,
    not waited for, so that its start overlaps the forwards of :func:`test_trained_checkpoint_converts_back`;
    the serving test waits for it."""
    from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

    args = [*CPU_ARGS, *ONE_PROCESS_ARGS, "--dtype", "float32", "--served-model-name", "apertus"]
    srv = VLLMServer(trained_hf, args=args, python=interpreter("vllm"), log_path=work / "vllm.log",
                     env={"PYTHONPATH": str(ROOT)}, startup_timeout=900).launch()
    try:
        yield srv
    finally:
        srv.stop()


def test_trained_checkpoint_converts_back(data: Data, trained: Path, trained_hf: Path, request_file: Path,
                                         work: Path, trained_server) -> None:
    # trained_server: only launched here (its start overlaps these forwards); the next test uses it
    meg = megatron_forward(trained, request_file, work / "megatron-trained.json")
    ref = port_forward(trained_hf, request_file, work / "port-trained.json")
    diff = max_diff(meg, ref)
    before = max_diff(meg, json.loads((work / "megatron-released.json").read_text()))
    print(f"to-hf: Megatron forward of the trained checkpoint vs the port on its conversion, max abs diff {diff:.3e} "
          f"(training moved the logits by up to {before:.3f})")
    assert diff < BOUND_LOGITS and before > 100 * BOUND_LOGITS


def test_trained_checkpoint_serves_with_megatrons_numbers(trained: Path, trained_hf: Path, request_file: Path,
                                                          work: Path, trained_server) -> None:
    from apertus_plugins.infra.client import http_json

    req = json.loads(request_file.read_text())
    meg = json.loads((work / "megatron-trained.json").read_text()) if (work / "megatron-trained.json").is_file() \
        else megatron_forward(trained, request_file, work / "megatron-trained.json")
    srv = trained_server.wait_ready()
    status, body = http_json(srv.url("/v1/completions"), {
        "model": "apertus", "prompt": req["prompt_ids"], "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": 1, "return_tokens_as_token_ids": True}, timeout=600)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    tokens = [int(re.sub(r"^token_id:", "", t)) for t in lp["tokens"]]
    diffs = [abs(a - b) for a, b in zip(lp["token_logprobs"], meg["logprobs"], strict=True)]
    print(f"vLLM vs Megatron greedy: tokens {tokens} vs {meg['tokens']}; log-prob max abs diff {max(diffs):.3e}; "
          f"smallest top-2 margin {min(meg['margins']):.3f}")
    # greedy choices are only comparable where they are not near-ties
    assert min(meg["margins"]) > 10 * BOUND_LOGPROBS, meg["margins"]
    assert tokens == meg["tokens"]
    assert max(diffs) < BOUND_LOGPROBS
