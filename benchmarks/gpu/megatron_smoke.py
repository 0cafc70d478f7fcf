"""Train a tiny Apertus 1.5 model for a few dozen steps with Megatron-LM through ``apertus-megatron``, on a GPU.

One command on a machine with one CUDA GPU (a few minutes)::

    MEGATRON_LM=/path/to/Megatron-LM python benchmarks/gpu/megatron_smoke.py run --out /tmp/smoke

It writes a blend of pretraining data (documents of every modality) and SFT data (conversations
tokenized by the core's chat tokenizer) with a manifest, runs upstream ``pretrain_gpt.py`` through
the launcher (``torchrun -m megatron_patches.launcher``) with the Apertus layer spec, the
per-modality loss targets, Goldfish and AdEMAMix, then checks from Megatron's own log that the
loss falls and that the per-modality losses (``text loss``, ``image loss``, ...) are logged, and
prints what it measured. Exit status 0 when both hold.

The Megatron-LM checkout (``megatron.training``, ``pretrain_gpt.py``; the same release as the
installed megatron-core, 0.16.x) comes from ``$MEGATRON_LM`` or ``--megatron-lm``. ``prepare`` (run
where PyPI is reachable) copies the needed part of a checkout to ``.megatron-lm/`` and downloads
the wheels the GPU machine lacks into ``.whl/`` (megatron-core, this package, and Megatron-LM's
import-time needs), so that both can be carried there::

    python benchmarks/gpu/megatron_smoke.py prepare --megatron-lm /path/to/Megatron-LM
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Parts of a Megatron-LM checkout the run imports (megatron.core comes from the wheel).
CHECKOUT_PARTS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/training", "megatron/legacy",
                  "megatron/post_training", "megatron/rl")
#: Wheels the GPU image lacks: megatron-core, and what megatron.training 0.16 imports at start-up.
WHEELS = ("megatron-core==0.16.1", "six", "pydantic", "pydantic-core", "typing-inspection", "annotated-types",
          "ipython", "asttokens", "executing", "pure-eval", "stack-data", "traitlets", "decorator", "jedi", "parso",
          "prompt-toolkit", "wcwidth", "pexpect", "ptyprocess", "matplotlib-inline", "ipython-pygments-lexers",
          "soundfile", "cffi", "pycparser")
SEQ = 256
MODALITY_KEYS = ("text loss", "omni loss", "image loss", "audio loss")


class SmokeError(RuntimeError):
    """The run cannot start or its result is wrong; the message says which."""


# ------------------------------------------------------------------------------------------ setup
def megatron_checkout(path: str | None) -> Path:
    """The Megatron-LM checkout from ``--megatron-lm`` or ``$MEGATRON_LM``, checked."""
    given = path or os.environ.get("MEGATRON_LM")
    if not given:
        raise SmokeError("no Megatron-LM checkout: set MEGATRON_LM=/path/to/Megatron-LM or pass --megatron-lm (the "
                         "repository of the installed megatron-core's release, with pretrain_gpt.py and "
                         "megatron/training)")
    root = Path(given)
    missing = [p for p in ("pretrain_gpt.py", "megatron/training/__init__.py") if not (root / p).exists()]
    if missing:
        raise SmokeError(f"{root}: not a Megatron-LM checkout (missing {', '.join(missing)})")
    return root


def write_data(out: Path) -> dict[str, Any]:
    """Tokenizer, a pretraining prefix, an SFT prefix and their manifest under ``out``."""
    import numpy as np

    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.data.indexed import IndexedDatasetWriter, optimal_dtype
    from apertus_plugins.data.manifest import write_manifest
    from apertus_plugins.testing.tokenizer_builder import SAMPLE_CORPUS, build_test_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    spec = VocabSpec.scaled()
    tok_dir = build_test_tokenizer(out / "tokenizer", spec, with_templates=False)
    chat = ChatTokenizer(tok_dir)
    rng = np.random.default_rng(0)
    sentences = [s.strip() for s in re.split(r"(?<=[.?!])\s+", SAMPLE_CORPUS) if s.strip()]
    img, aud = spec.modality("image"), spec.modality("audio")
    pre, sft = out / "pretrain", out / "sft"
    with IndexedDatasetWriter(pre, optimal_dtype(spec.size)) as w:
        for d in range(600):  # learnable structure: real text, image rows that repeat a pattern, audio ramps
            text = chat.text_ids(" ".join(rng.choice(sentences, 3)))
            parts = [[spec.bos_id], text]
            if d % 2 == 0:
                row = rng.integers(img.offset, img.end, 8)
                grid = np.concatenate([np.append(row, spec.id("img_end_of_row")) for _ in range(4)])
                parts += [[spec.id("img_start")], grid, [spec.id("img_end")]]
            if d % 3 == 0:
                start = int(rng.integers(0, aud.size - 16))
                parts += [[spec.id("audio_start")], aud.offset + start + np.arange(16), [spec.id("audio_end")],
                          [spec.id("stt_transcribe")], chat.text_ids(str(rng.choice(sentences)))]
            parts.append([spec.eos_id])
            w.add_document(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    with IndexedDatasetWriter(sft, optimal_dtype(spec.size)) as w:
        for _ in range(200):
            q, a = rng.choice(sentences, 2)
            conv = [{"role": "user", "content": str(q)}, {"role": "assistant", "content": str(a)}]
            w.add_document(chat.encode_conversation(conv, variant="training").ids)
    manifest = out / "manifest.json"
    write_manifest([str(pre), str(sft)], manifest)
    return {"tokenizer": tok_dir, "pretrain": str(pre), "sft": str(sft), "manifest": manifest,
            "vocab": spec.size, "rows": -(-(spec.size + 1) // 128) * 128}


def model_flags(*, seq: int, micro_batch: int, global_batch: int, iters: int, warmup: int) -> list[str]:
    """``pretrain_gpt.py`` flags of the tiny Apertus model and its schedule, shared by the GPU checks (each adds its
    kernels, its data and the plugin's flags)."""
    return [
        "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "32",
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--qk-layernorm", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rotary-base", "500000",
        "--use-rope-scaling", "--rope-scaling-factor", "8.0", "--max-position-embeddings", str(seq),
        "--seq-length", str(seq), "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(warmup), "--clip-grad", "1.0", "--weight-decay", "0.1", "--bf16",
        "--optimizer", "adam",
    ]


def data_flags(data: dict[str, Any], *, log_interval: int) -> list[str]:
    """The blend :func:`write_data` wrote (0.6 pretraining, 0.4 SFT), no evaluation, and the logging."""
    return [
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(data["vocab"]),
        "--data-path", "0.6", data["pretrain"], "0.4", data["sft"], "--split", "100,0,0",
        "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", str(log_interval), "--seed", "1234",
        "--num-workers", "1",
    ]


def plugin_flags(data: dict[str, Any]) -> list[str]:
    """The plugin's flags every GPU check passes: the tokenizer, the embedding rows, the SFT prefix, the manifest
    and Goldfish at the report's k = h = 50."""
    return [
        "--apertus-tokenizer", str(data["tokenizer"]), "--apertus-embedding-rows", str(data["rows"]),
        "--apertus-sft-data", data["sft"], "--apertus-manifest", str(data["manifest"]),
        "--apertus-goldfish-k", "50", "--apertus-goldfish-h", "50",
    ]


def megatron_flags(data: dict[str, Any], out: Path, iters: int = 40) -> list[str]:
    """``pretrain_gpt.py`` flags of the tiny run (local modules: no Transformer Engine or Apex needed)."""
    return [
        *model_flags(seq=SEQ, micro_batch=8, global_batch=16, iters=iters, warmup=4),
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        *data_flags(data, log_interval=5), "--save", str(out / "ckpt"), "--save-interval", str(iters),
        # the plugin
        *plugin_flags(data), "--apertus-targets", "all", "--apertus-optimizer", "ademamix", "--apertus-ademamix-alpha-warmup", "20",
        "--apertus-ademamix-beta3-warmup", "20", "--apertus-ademamix-beta3", "0.999",
    ]


def torchrun(script: Path, checkout: Path | None, flags: list[str], *, nproc: int, port: int) -> tuple[int, str]:
    """``script`` run through the launcher (``torchrun -m megatron_patches.launcher``) on ``nproc`` GPUs, with the
    Megatron-LM checkout (if any) and this repository on ``PYTHONPATH``: (exit status, the whole log)."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout) if checkout else "", str(ROOT),
                                                    env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           "-m", "megatron_patches.launcher", str(script), *flags]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|")
_LOSS = re.compile(r"\|\s*([a-z][a-z ]*? loss):\s*([-+0-9.eEnaif]+)\s*(?=\|)")
_TIME = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")


def parse_log(text: str) -> list[dict[str, float]]:
    """Megatron's training-log lines as ``[{"iteration": i, "lm loss": x, "text loss": y, ...}, ...]``."""
    rows = []
    for line in text.splitlines():
        m = _ITER.search(line)
        if not m:
            continue
        row: dict[str, float] = {"iteration": float(m.group(1))}
        row.update({k: float(v) for k, v in _LOSS.findall(line)})
        t = _TIME.search(line)
        if t:
            row["ms per iteration"] = float(t.group(1))
        if "lm loss" in row:
            rows.append(row)
    return rows


def check_log(rows: list[dict[str, float]], *, drop: float = 0.8) -> dict[str, Any]:
    """The measurements; raises :class:`SmokeError` unless the loss falls and every modality loss is logged."""
    if len(rows) < 2:
        raise SmokeError(f"found {len(rows)} training-log lines with an lm loss; need at least 2")
    # a modality is logged in the iterations whose batch holds its targets: each must appear somewhere
    missing = [k for k in MODALITY_KEYS if not any(k in r for r in rows)]
    if missing:
        raise SmokeError(f"the log lacks the per-modality losses {missing} (is the Apertus forward step in use?)")
    first, last = rows[0]["lm loss"], rows[-1]["lm loss"]
    if not last < drop * first:
        raise SmokeError(f"the loss did not fall: {first:.4f} at iteration {rows[0]['iteration']:.0f}, {last:.4f} at "
                         f"{rows[-1]['iteration']:.0f} (want < {drop} x)")
    return {"first": rows[0], "last": rows[-1], "lm loss ratio": last / first,
            "ms per iteration": rows[-1].get("ms per iteration")}


# ------------------------------------------------------------------------------------------ commands
def cmd_run(args: argparse.Namespace) -> int:
    checkout = megatron_checkout(args.megatron_lm)
    import torch

    if not torch.cuda.is_available():
        raise SmokeError("no CUDA device: this script trains on a GPU")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    data = write_data(out)
    flags = megatron_flags(data, out, args.iters)
    t1 = time.time()
    status, log = torchrun(checkout / "pretrain_gpt.py", checkout, flags, nproc=1, port=29531)
    (out / "train.log").write_text(log)
    print(log[-6000:])
    if status != 0:
        raise SmokeError(f"training exited with status {status} (log: {out / 'train.log'})")
    result = check_log(parse_log(log))
    result.update({"data seconds": round(t1 - t0, 1), "train seconds": round(time.time() - t1, 1),
                   "checkpoint written": (out / "ckpt" / "latest_checkpointed_iteration.txt").is_file(),
                   "gpu": torch.cuda.get_device_name(0)})
    print(json.dumps(result, indent=2))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    src = megatron_checkout(args.megatron_lm)
    dest = ROOT / ".megatron-lm"
    if dest.exists():
        shutil.rmtree(dest)
    for part in CHECKOUT_PARTS:
        p = src / part
        (dest / part).parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir():
            shutil.copytree(p, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.is_file():
            shutil.copy2(p, dest / part)
    wheels = ROOT / ".whl"
    wheels.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(ROOT)], check=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["manylinux2014_x86_64"]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "-d", str(wheels)]
    for p in platforms:
        base += ["--platform", p]
    for w in WHEELS:
        subprocess.run([*base, w], check=True)
    print(f"prepared {dest} and {wheels}; carry both (.megatron-lm and .whl) and run on the GPU machine:\n"
          "  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
          "PYTHONPATH=/tmp/site MEGATRON_LM=.megatron-lm python3 benchmarks/gpu/megatron_smoke.py run --out /tmp/smoke")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="write the data, train through apertus-megatron, check the log")
    run.add_argument("--out", default="/tmp/apertus-megatron-smoke")
    run.add_argument("--iters", type=int, default=40)
    run.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout (default $MEGATRON_LM)")
    run.set_defaults(func=cmd_run)
    prep = sub.add_parser("prepare", help="copy the Megatron-LM parts and download the wheels to carry")
    prep.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout (default $MEGATRON_LM)")
    prep.set_defaults(func=cmd_prepare)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SmokeError as exc:
        print(f"megatron_smoke: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
