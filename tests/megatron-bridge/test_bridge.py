"""Apertus 1.5 through Megatron-Bridge's public API (``AutoBridge``), on CPU, at TP=1 and TP=2.

One ``torchrun --nproc-per-node 2`` of :mod:`bridge_worker` (the megatron-train suite's CPU harness,
gloo) on a tiny random checkpoint in the released layout (``varied`` weights, tokenizer inside):

* ``AutoBridge.from_hf_pretrained`` picks the registered Apertus bridge and its provider builds the
  Apertus spec: ``ApertusMLP`` with a per-layer xIELU, QK-norm (RMSNorm), no biases, a non-gated MLP,
  untied embedding and output layer, llama3 RoPE scaling; the media tokenizers are not in the model;
* its logits over the released head (the text ids) equal the released ``transformers`` port's on a
  prompt with text, image and audio ids (the port runs in the ``reference`` suite's environment),
  within the parity test's bound (1e-4, float32);
* ``export_hf_weights`` gives back every tensor of the checkpoint (194: decoder, head, media
  tokenizers, xIELU constants) bit for bit, with the same dtypes;
* a checkpoint whose ``config.json`` names another image placeholder id than its tokenizer is refused,
  the message naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from apertus_plugins.testing.serve import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CPU_SITE = ROOT / "tests" / "megatron-train" / "cpu_site"
REFERENCE_FORWARD = ROOT / "tests" / "megatron-train" / "reference_forward.py"
BOUND_LOGITS = 1e-4  # test_parity.py's bound


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apertus_plugins.testing.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("bridge")
    ckpt = write_checkpoint(root / "checkpoint", size="tiny", init="varied")
    config = json.loads((ckpt / "config.json").read_text())
    text = config["text_config"]
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, text["output_vocab_size"], 12)]
    ids += [config["image_token_id"]] + [config["image_token_offset"] + int(i) for i in rng.integers(0, 64, 6)]
    ids += [config["audio_token_id"]] + [config["audio_token_offset"] + int(i) for i in rng.integers(0, 64, 4)]
    (root / "request.json").write_text(json.dumps({"prompt_ids": ids, "head_rows": text["output_vocab_size"]}))
    bad = root / "bad-layout"
    shutil.copytree(ckpt, bad)
    config["image_token_id"] = config["audio_token_id"] + 1
    (bad / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def bridged(work: Path) -> Path:
    out = work / "out"
    out.mkdir()
    env = dict(os.environ, APERTUS_MEGATRON_CPU="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SITE), str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(HERE / "bridge_worker.py"), str(work / "checkpoint"),
           str(work / "request.json"), str(out), str(work / "bad-layout")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
    assert res.returncode == 0, f"bridge worker failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def port_logits(work: Path) -> np.ndarray:
    python = os.environ.get("APERTUS_PYTHON_REFERENCE")
    assert python, "APERTUS_PYTHON_REFERENCE is not set: run the suite through tools/dev.py (needs.txt)"
    out = work / "port.json"
    res = subprocess.run([python, str(REFERENCE_FORWARD), str(work / "checkpoint"), str(work / "request.json"),
                          str(out)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return np.asarray(json.loads(out.read_text())["logits"], dtype=np.float64)


@pytest.mark.parametrize("tp", [1, 2])
def test_autobridge_builds_the_apertus_spec_with_the_ports_logits(bridged: Path, port_logits: np.ndarray,
                                                                   work: Path, tp: int) -> None:
    got = json.loads((bridged / f"tp{tp}.json").read_text())
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    text = config["text_config"]
    assert got["provider"] == "ApertusModelProvider"
    assert (got["mlp"], got["activation"], got["q_layernorm"]) == ("ApertusMLP", "XIELU", "RMSNorm")
    assert got["qk_layernorm"] and got["untied"] and not got["gated"] and not got["bias"]
    assert got["normalization"] == "RMSNorm"
    assert got["embedding_rows"] == got["output_rows"] == text["vocab_size"]
    rope = text["rope_parameters"]
    assert got["rope_scaling"] and got["rope_scaling_factor"] == rope["factor"] and got["rotary_base"] == rope["rope_theta"]
    assert got["trainable"] == ["decoder", "embedding", "output_layer"]  # no media tokenizer in the model
    logits = np.asarray(got["logits"], dtype=np.float64)
    assert logits.shape == port_logits.shape == (len(json.loads((work / "request.json").read_text())["prompt_ids"]),
                                                 text["output_vocab_size"])
    diff = float(np.abs(logits - port_logits).max())
    print(f"TP={tp}: AutoBridge's Megatron model vs the transformers port, max abs logit diff {diff:.3e}")
    assert diff < BOUND_LOGITS


@pytest.mark.parametrize("tp", [1, 2])
def test_export_gives_the_checkpoint_back_bit_for_bit(bridged: Path, work: Path, tp: int) -> None:
    original = load_file(str(work / "checkpoint" / "model.safetensors"))
    exported = load_file(str(bridged / f"tp{tp}.safetensors"))
    assert sorted(exported) == sorted(original)
    differ = [n for n, t in original.items() if exported[n].dtype != t.dtype or not torch.equal(exported[n], t)]
    assert not differ, differ[:5]
    assert any(n.startswith("model.vision_tokenizer.") for n in exported) and "lm_head.weight" in exported


def test_a_checkpoint_with_another_vocabulary_layout_is_refused(bridged: Path) -> None:
    message = (bridged / "refused.txt").read_text()
    assert "config.json image_token_id" in message and "vocabulary layout differs" in message, message
