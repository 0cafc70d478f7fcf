"""Shared pieces of the megatron-train suite: the data, the tiny model's flags, a torchrun runner, the log parser.

The data is written the way a user writes it: images and audio clips (with captions and
transcripts) through ``apertus tokenize pretrain`` with the encoders of a tiny random checkpoint
(``apertus make-checkpoint``'s layout), conversations through ``apertus tokenize sft`` (with the
stored mask stream), plain text documents through the core's indexed-dataset writer, and a
manifest over all of it (``apertus manifest write``). Training runs are real: ``torchrun ...
apertus-megatron pretrain_gpt.py <Megatron flags> --apertus-...`` on CPU over gloo, each worker
patched by ``cpu_site/sitecustomize.py`` (the harness in ``cpu_patches.py``).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from apertus_plugins.testing.serve import free_port, kill_group

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DRIVER = HERE / "pretrain_gpt.py"
CPU_SITE = HERE / "cpu_site"
BIN = Path(sys.executable).parent


# ------------------------------------------------------------------------------------------ data
def _png(rng: np.random.Generator, h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def _wav(rng: np.random.Generator, seconds: float, rate: int = 24000) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, (rng.standard_normal(int(seconds * rate)) * 0.2).astype(np.float32), rate, format="WAV",
             subtype="PCM_16")
    return buf.getvalue()


SENTENCES = ["The Swiss AI Initiative trains open models.", "It is three degrees and sunny in Bern today.",
             "Apertus reads images and audio as discrete tokens.", "La Suisse a quatre langues nationales.",
             "Die Schweiz hat vier Landessprachen.", "Please call the tool and report the result."]


def conversations() -> list[dict[str, Any]]:
    """SFT records: answered questions, one with an image, and user turns left without an answer."""
    out: list[dict[str, Any]] = []
    for i in range(8):
        q, a = SENTENCES[i % 6], SENTENCES[(i + 2) % 6]
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    out.append({"messages": [{"role": "user", "content": [{"type": "image", "image": "media/pic.png"},
                                                          {"type": "text", "text": "What is this?"}]},
                             {"role": "assistant", "content": "<think>Noise.</think>Random pixels."}]})
    for i in range(4):  # no assistant turn: no SFT target at all
        out.append({"messages": [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": SENTENCES[i]}]})
    return out


@dataclass(frozen=True)
class Data:
    root: Path
    checkpoint: Path  # the tiny random checkpoint whose encoders tokenized the media (tokenizer inside)
    tokenizer: Path
    images: str
    audio: str
    text: str
    sft: str
    pretrain_manifest: Path
    sft_manifest: Path
    embedding_rows: int
    vocab: int


def _apertus(*args: str) -> None:
    cmd = [sys.executable, "-m", "apertus_plugins.cli", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def build_data(root: Path) -> Data:
    """Every prefix of the suite, written by the user-facing commands (a few seconds on two cores)."""
    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.data.indexed import IndexedDatasetWriter, optimal_dtype
    from apertus_plugins.testing.checkpoint import write_checkpoint

    rng = np.random.default_rng(0)
    ckpt = write_checkpoint(root / "checkpoint", size="tiny", init="varied")
    spec = VocabSpec.from_tokenizer_dir(ckpt)
    src = root / "in"
    for k in range(6):
        (src / "img").mkdir(parents=True, exist_ok=True)
        (src / "img" / f"{k}.png").write_bytes(_png(rng, 64 + 16 * (k % 2), 64))
        (src / "img" / f"{k}.txt").write_text(SENTENCES[k], encoding="utf-8")
    for k in range(5):
        (src / "aud").mkdir(parents=True, exist_ok=True)
        (src / "aud" / f"{k}.wav").write_bytes(_wav(rng, 0.2 + 0.05 * k))
        if k % 2 == 0:
            (src / "aud" / f"{k}.txt").write_text(SENTENCES[k], encoding="utf-8")
    (src / "media").mkdir(exist_ok=True)
    (src / "media" / "pic.png").write_bytes(_png(rng, 64, 64))
    (src / "conv.jsonl").write_text("\n".join(json.dumps(c) for c in conversations()) + "\n", encoding="utf-8")
    data = root / "data"
    common = ["--tokenizer", str(ckpt), "--checkpoint", str(ckpt), "--workers", "0", "--no-progress"]
    _apertus("tokenize", "pretrain", str(src / "img"), "--out", str(data / "images"), *common)
    _apertus("tokenize", "pretrain", str(src / "aud"), "--out", str(data / "audio"), *common)
    _apertus("tokenize", "sft", str(src / "conv.jsonl"), "--out", str(data / "sft"), "--mask-stream", *common)
    chat = ChatTokenizer(ckpt)
    with IndexedDatasetWriter(data / "text", optimal_dtype(spec.size)) as w:
        for k in range(40):
            ids = chat.text_ids(" ".join(SENTENCES[(k + j) % 6] for j in range(1 + k % 3)))
            w.add_document(np.concatenate([[spec.bos_id], ids, [spec.eos_id]]).astype(np.int64))
    prefixes = [str(data / n) for n in ("images", "audio", "text", "sft")]
    # one frozen dataset list per stage: the pretraining blend, and the SFT prefix with its mask stream
    _apertus("manifest", "write", *prefixes[:3], "--out", str(data / "pretrain.manifest.json"))
    _apertus("manifest", "write", prefixes[3], prefixes[3] + ".mask", "--out", str(data / "sft.manifest.json"))
    rows = int(math.ceil(spec.size / 128) * 128)
    return Data(root, ckpt, ckpt, *prefixes, pretrain_manifest=data / "pretrain.manifest.json",
                sft_manifest=data / "sft.manifest.json", embedding_rows=rows, vocab=spec.size)


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    return build_data(tmp_path_factory.mktemp("megatron-train"))


# ------------------------------------------------------------------------------------------ runs
def model_flags(*, layers: int = 2, hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128,
                seq: int = 64) -> list[str]:
    """The tiny Apertus decoder in Megatron flags (local modules, fusions off: the CPU path)."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
        "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups", str(groups),
        "--kv-channels", str(hidden // heads), "--normalization", "RMSNorm", "--norm-epsilon", "1e-05",
        "--qk-layernorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--rotary-base", "500000", "--use-rope-scaling",
        "--rope-scaling-factor", "8", "--max-position-embeddings", str(max(seq, 128)), "--seq-length", str(seq),
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-cpu-initialization", "--init-method-std", "0.02",
    ]


def train_flags(data: Data, *, iters: int, mbs: int = 2, gbs: int = 4) -> list[str]:
    """Optimizer, schedule, data and logging flags of a short CPU run (float32, gloo)."""
    return [
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--optimizer", "adam", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(data.vocab),
        "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1",
        "--seed", "1234", "--num-workers", "0", "--distributed-backend", "gloo",
        "--apertus-tokenizer", str(data.tokenizer), "--apertus-embedding-rows", str(data.embedding_rows),
    ]


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a patched run: the harness's site folder first, this checkout next (a new
    dict each call: a caller may change its copy)."""
    env = dict(os.environ, APERTUS_MEGATRON_CPU="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SITE), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


@dataclass
class Run:
    returncode: int
    log: str
    rows: list[dict[str, Any]]

    def losses(self, key: str = "lm loss") -> dict[int, float]:
        return {r["iteration"]: r[key] for r in self.rows if key in r}


def torchrun(args: Sequence[str], *, nproc: int = 1, plugin: bool = True, cwd: Path | None = None,
             timeout: float = 600, check: bool = True, env: dict[str, str] | None = None) -> Run:
    """``torchrun --nproc-per-node N [apertus-megatron] pretrain_gpt.py ARGS``."""
    entry = [str(BIN / "apertus-megatron")] if plugin else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *entry, str(DRIVER), *args]
    with tempfile.TemporaryFile("w+", prefix="torchrun-", suffix=".log") as out:
        # the log goes to a file, not a pipe: a killed rank's checkpoint-writer processes outlive it
        # and would hold a pipe open; the run's whole process group is ended afterwards
        proc = subprocess.Popen(cmd, cwd=cwd or tempfile.gettempdir(), env=env or cpu_env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            kill_group(proc)
        out.seek(0)
        log = out.read()
    run = Run(rc, log, parse_log(log))
    if check and rc != 0:
        raise AssertionError(f"training failed ({rc}):\n{log[-6000:]}")
    return run


_ITER = re.compile(r"\] iteration\s+(\d+)/\s*\d+\s*\|")
_FIELD = re.compile(r"\|\s*([a-z][a-z ]*?):\s*([-+0-9.eEnaif]+)\s*(?=\|)")
EMPTY = re.compile(r"\[apertus\] iteration\s+(\d+): the global batch holds no loss target")
EXACT_NORM = re.compile(r"\[cpu_patches\] iteration (\d+) grad norm ([-+0-9.eEnaif]+)")


def parse_log(text: str) -> list[dict[str, Any]]:
    """Megatron's training-log lines: ``[{"iteration": i, "lm loss": x, "text loss": y, "grad norm": g, ...}]``."""
    rows = []
    empty = {int(m.group(1)) for m in EMPTY.finditer(text)}
    exact = {int(m.group(1)): float(m.group(2)) for m in EXACT_NORM.finditer(text)}
    for line in text.splitlines():
        m = _ITER.search(line)
        if not m:
            continue
        row: dict[str, Any] = {"iteration": int(m.group(1))}
        for k, v in _FIELD.findall(line):
            try:
                row[k] = float(v)
            except ValueError:
                continue
        row["no targets"] = row["iteration"] in empty
        if row["iteration"] in exact and "grad norm" in row:
            row["grad norm"] = exact[row["iteration"]]  # the harness's full-precision value
        rows.append(row)
    return rows


def assert_trained(run: Run, iters: int, keys: Sequence[str] = ("lm loss",)) -> None:
    done = [r["iteration"] for r in run.rows]
    assert done == list(range(1, iters + 1)), f"iterations logged: {done}\n{run.log[-4000:]}"
    for r in run.rows:
        if r["no targets"]:
            continue
        for k in keys:
            assert k in r and math.isfinite(r[k]), f"iteration {r['iteration']}: {k} missing or not finite: {r}"


# ------------------------------------------------------------------------------------------ shared runs
PRETRAIN_ITERS = 8


def pretrain_args(data: Data, *extra: str, iters: int = PRETRAIN_ITERS) -> list[str]:
    """The continued-pretraining run: the blend, a step schedule of the image weight, Goldfish, AdEMAMix."""
    return [*model_flags(), *train_flags(data, iters=iters),
            "--data-path", "0.5", data.images, "0.2", data.audio, "0.3", data.text,
            "--apertus-manifest", str(data.pretrain_manifest),
            "--apertus-modality-weight", "image=0:1,2:1,3:0",
            "--apertus-goldfish-k", "4", "--apertus-goldfish-h", "4",
            "--apertus-optimizer", "ademamix", "--apertus-ademamix-alpha-warmup", "4",
            "--apertus-ademamix-beta3-warmup", "4", "--apertus-ademamix-beta3", "0.999", *extra]


@pytest.fixture(scope="session")
def pretrain_run(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted TP=1 run of :func:`pretrain_args` (the reference of the resume and TP=2 tests)."""
    return torchrun(pretrain_args(data), cwd=tmp_path_factory.mktemp("pretrain"))
