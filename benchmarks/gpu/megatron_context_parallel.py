"""Context parallelism with Transformer Engine's THD attention on two GPUs: CP=2 against CP=1, through ``apertus-megatron``.

One command on a machine with two CUDA GPUs and Transformer Engine (a few minutes)::

    python benchmarks/gpu/megatron_context_parallel.py run --out /tmp/cp

It writes a blend (pretraining documents of every modality and SFT conversations, the data of
``megatron_smoke.py``), then trains the same tiny Apertus model twice with
``--transformer-impl transformer_engine --bf16 --apertus-packed-sequences`` on packed documents
(``--apertus-bfd-data`` and ``--apertus-sft-data``, Goldfish on): once on one GPU (CP=1) and once on
two (``--context-parallel-size 2``), both with ``--apertus-pad-to-multiple 4`` so that they read the
same samples. From Megatron's own logs it checks that both runs log every iteration, that the
loss falls, and that each iteration's ``lm loss`` and per-modality losses agree within the bf16
tolerance (``--rtol``, default 2e-2: Transformer Engine's CP attention accumulates in another
order). Prints what it measured as JSON; exit status 0 when all holds.

The training script: with megatron-core 0.19 (its wheel packages ``megatron.training``) the
repository's ``tests/megatron-train/pretrain_gpt.py`` (0.19's ``pretrain_gpt.py`` shape); with 0.16,
``pretrain_gpt.py`` of a Megatron-LM checkout of the same release, from ``$MEGATRON_LM`` or
``--megatron-lm``. The CPU suite runs the same comparison with an exact attention of its own
(``tests/megatron-train/test_context_parallel.py``); this script is the check with the real one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SEQ = 1024
ITERS = 12
PAD = 4


class CpCheckError(RuntimeError):
    """The check cannot run or its result is wrong; the message says which."""


def _smoke() -> Any:
    spec = importlib.util.spec_from_file_location("megatron_smoke", HERE / "megatron_smoke.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def training_script(megatron_lm: str | None) -> tuple[Path, Path | None]:
    """(the pretrain_gpt.py to run, the Megatron-LM checkout to put on PYTHONPATH or None)."""
    given = megatron_lm or os.environ.get("MEGATRON_LM")
    if given:
        checkout = _smoke().megatron_checkout(given)
        return checkout / "pretrain_gpt.py", checkout
    if importlib.util.find_spec("megatron.training") is None:
        raise CpCheckError("megatron.training is not installed (megatron-core 0.16 has no training loop in its wheel): "
                           "set MEGATRON_LM=/path/to/Megatron-LM or pass --megatron-lm, or install megatron-core 0.19")
    return ROOT / "tests" / "megatron-train" / "pretrain_gpt.py", None


def megatron_flags(data: dict[str, Any], iters: int = ITERS) -> list[str]:
    """The tiny model with Transformer Engine, bf16, packed documents padded for CP=2 (the CP size is added per run)."""
    smoke = _smoke()
    return [
        *smoke.model_flags(seq=SEQ, micro_batch=1, global_batch=4, iters=iters, warmup=2),
        "--transformer-impl", "transformer_engine", "--no-bias-gelu-fusion",
        *smoke.data_flags(data, log_interval=1), "--attention-dropout", "0", "--hidden-dropout", "0",
        # the plugin: packed documents, split over the CP ranks as Transformer Engine's THD attention expects
        *smoke.plugin_flags(data), "--apertus-bfd-data", data["pretrain"], "--apertus-packed-sequences",
        "--apertus-pad-to-multiple", str(PAD),
    ]


def compare(one: list[dict[str, float]], two: list[dict[str, float]], rtol: float) -> dict[str, Any]:
    """Iteration by iteration, the losses of both runs; raises :class:`CpCheckError` unless they agree within ``rtol``."""
    a = {int(r["iteration"]): r for r in one}
    b = {int(r["iteration"]): r for r in two}
    if not a or a.keys() != b.keys():
        raise CpCheckError(f"the runs logged different iterations: CP=1 {sorted(a)}, CP=2 {sorted(b)}")
    worst: dict[str, float] = {}
    for i in sorted(a):
        keys = {k for k in a[i] if k.endswith(" loss")}
        if keys != {k for k in b[i] if k.endswith(" loss")}:
            raise CpCheckError(f"iteration {i}: CP=1 logged {sorted(keys)}, CP=2 {sorted(k for k in b[i] if 'loss' in k)}")
        for k in keys:
            rel = abs(a[i][k] - b[i][k]) / max(abs(a[i][k]), 1e-12)
            worst[k] = max(worst.get(k, 0.0), rel)
            if not math.isfinite(b[i][k]) or rel > rtol:
                raise CpCheckError(f"iteration {i}: {k} {a[i][k]:.6f} at CP=1, {b[i][k]:.6f} at CP=2 (relative "
                                   f"difference {rel:.2e} > {rtol})")
    return {"iterations": len(a), "max relative difference": worst}


def _train(script: Path, checkout: Path | None, flags: list[str], nproc: int, log: Path) -> list[dict[str, float]]:
    status, text = _smoke().torchrun(script, checkout, flags, nproc=nproc, port=29540 + nproc)
    log.write_text(text)
    if status != 0:
        print(text[-6000:])
        raise CpCheckError(f"training with {nproc} GPU(s) exited with status {status} (log: {log})")
    return _smoke().parse_log(text)


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        raise CpCheckError(f"this check needs two CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if importlib.util.find_spec("transformer_engine") is None:
        raise CpCheckError("Transformer Engine is not installed: context parallelism with packed sequences is its THD "
                           "attention")
    script, checkout = training_script(args.megatron_lm)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    data = _smoke().write_data(out)
    flags = megatron_flags(data, args.iters)
    one = _train(script, checkout, [*flags, "--context-parallel-size", "1"], 1, out / "cp1.log")
    two = _train(script, checkout, [*flags, "--context-parallel-size", "2"], 2, out / "cp2.log")
    result = compare(one, two, args.rtol)
    falls = _smoke().check_log(one)
    result.update({"lm loss CP=1": [r["lm loss"] for r in one], "lm loss CP=2": [r["lm loss"] for r in two],
                   "lm loss ratio (last/first)": falls["lm loss ratio"], "seconds": round(time.time() - t0, 1),
                   "gpu": torch.cuda.get_device_name(0)})
    print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="write the data, train at CP=1 and CP=2, compare the logs")
    run.add_argument("--out", default="/tmp/apertus-megatron-cp")
    run.add_argument("--iters", type=int, default=ITERS)
    run.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance of the losses (bf16)")
    run.add_argument("--megatron-lm", default=None, help="Megatron-LM checkout for megatron-core 0.16 (default "
                     "$MEGATRON_LM; with 0.19 the wheel's training loop and the repository's driver)")
    run.set_defaults(func=cmd_run)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CpCheckError as exc:
        print(f"megatron_context_parallel: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the smoke script's own errors (a bad checkout) carry their message
        if type(exc).__name__ == "SmokeError":
            print(f"megatron_context_parallel: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
