"""Iterations per second of the tiny model on CPU: the Apertus spec through ``apertus-megatron`` vs megatron-core's stock GPT.

    python3 tools/dev.py run megatron-train python benchmarks/bench_megatron_train.py [--iters 40]

Both runs are Megatron's real ``pretrain()`` loop (one process, gloo, the suite's CPU harness) on
the same model shape (2 layers, hidden 64, sequence 64 unless changed) and the same data (the
megatron-train suite's blend of images, audio and text, tokenized by ``apertus tokenize``):

* ``stock``: ``pretrain_gpt.py`` run directly: megatron-core's local GPT layer spec (GeLU MLP),
  ``GPTDataset``, upstream's loss;
* ``apertus``: the same script through ``apertus-megatron``: the Apertus layer spec (xIELU with
  per-layer scalars), ``ApertusDataset`` (loss targets, Goldfish, end-of-document rule, position
  resets, cross-document attention masks), the weighted loss with per-modality reports and the
  target check of each step, Adam in both.

The mean time per iteration comes from Megatron's own log (``elapsed time per iteration``), over
the iterations after the first five; printed side by side with the ratio. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron-train"))

from conftest import build_data, model_flags, torchrun, train_flags  # noqa: E402

WARMUP = 5


def ms_per_iteration(log: str) -> list[float]:
    import re

    return [float(m) for m in re.findall(r"elapsed time per iteration \(ms\):\s*([0-9.]+)", log)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-megatron-train-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        data = build_data(root)
        print(f"data written in {time.perf_counter() - t0:.1f} s (apertus tokenize pretrain/sft, manifest)")
        common = [*model_flags(hidden=args.hidden, seq=args.seq, ffn=2 * args.hidden),
                  *train_flags(data, iters=args.iters, mbs=args.micro_batch_size, gbs=args.micro_batch_size),
                  "--data-path", "0.5", data.images, "0.2", data.audio, "0.3", data.text]
        stock_args = _drop_apertus(common)  # the --apertus-* flags and their values
        results = {}
        for name, plugin, flags in (("stock GPT spec", False, stock_args),
                                    ("Apertus spec", True, [*common, "--apertus-goldfish-k", "50"])):
            t = time.perf_counter()
            run = torchrun(flags, plugin=plugin, cwd=root)
            wall = time.perf_counter() - t
            ms = ms_per_iteration(run.log)[WARMUP:]
            results[name] = (statistics.mean(ms), statistics.median(ms), wall)
    print(f"\ntiny model on CPU: {args.iters} iterations, hidden {args.hidden}, sequence {args.seq}, "
          f"micro-batch {args.micro_batch_size}, one process (mean over iterations {WARMUP + 1}..{args.iters})")
    print(f"{'':16s} {'ms/iter (mean)':>15s} {'ms/iter (median)':>17s} {'iter/s':>8s} {'run wall s':>11s}")
    for name, (mean, median, wall) in results.items():
        print(f"{name:16s} {mean:15.1f} {median:17.1f} {1000 / mean:8.1f} {wall:11.1f}")
    (sm, _, _), (am, _, _) = results["stock GPT spec"], results["Apertus spec"]
    print(f"Apertus / stock time per iteration: {am / sm:.2f}x")
    return 0


def _drop_apertus(flags: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for tok in flags:
        if tok.startswith("--"):
            skip = tok.startswith("--apertus-")
        if not skip:
            out.append(tok)
    return out


if __name__ == "__main__":
    sys.exit(main())
