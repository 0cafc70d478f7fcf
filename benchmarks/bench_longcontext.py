#!/usr/bin/env python3
"""Peak memory of ``apertus tokenize longcontext`` at each target length (report section 3.3).

For every target length (default: 32,768 and 262,144 tokens) a fresh process runs the generator
end to end (JSONL read, CWE / DocOrder / needles at the report's 8B mix of that step, written as
indexed datasets with the mask stream) and prints its peak resident memory (``ru_maxrss``), the
resident memory before generating (interpreter, numpy, the tokenizer loaded), the difference, and
the examples and tokens written. The generator streams: the difference is one example's working
set (a few bytes per token of the longest example), not the output's size. A second run at the
largest length with four times the examples shows that the peak does not grow with the output.

Source documents are random words (a 400-word vocabulary, Zipf-like frequencies), sized per length
for both buckets, written to a JSONL file first. The test tokenizer (``apertus_plugins.testing``)
is used; its short merges make about one token per 1.3 characters.

Usage: ``python benchmarks/bench_longcontext.py [--lengths 32768 262144] [--examples 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from apertus_plugins.core.longcontext import STEPS


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.longcontext import report_mix
    from apertus_plugins.data.longcontext import write_long_context

    chat = ChatTokenizer(args.tokenizer)
    chat.text_ids("warm up the tokenizer")
    before = _rss_mb()
    t0 = time.perf_counter()
    report = write_long_context([args.docs], args.out, chat, length=args.length, mix=report_mix("8b", "32k"),
                                seed=1, max_examples=args.examples)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"before_mb": before, "peak_mb": peak, "seconds": seconds, "examples": report["examples"],
                      "tokens": sum(report["tokens"].values()), "longest": report["longest"],
                      "skipped": report["skipped"]}))


def write_docs(path: Path, tokenizer: str, length: int, n: int, seed: int) -> None:
    from apertus_plugins.core.chat import ChatTokenizer

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, int(rng.integers(4, 9)))) for _ in range(400)]
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    sample = " ".join(rng.choice(vocab, 2000, p=p))
    per_word = len(ChatTokenizer(tokenizer).text_ids(sample)) / 2000
    with open(path, "w", encoding="utf-8") as fh:
        for k in range(n):
            share = rng.uniform(0.27, 0.48) if k % 2 else rng.uniform(0.52, 0.9)  # hard, easy
            words = int(share * length / per_word)
            fh.write(json.dumps({"text": " ".join(rng.choice(vocab, words, p=p))}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[STEPS["32k"], STEPS["256k"]])
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--docs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = str(build_test_tokenizer(Path(tmp) / "tok", VocabSpec.scaled(), with_templates=False))
        runs = [(length, args.examples) for length in args.lengths] + [(max(args.lengths), 4 * args.examples)]
        print(f"{'length':>8} {'examples':>8} {'tokens':>10} {'longest':>8} {'before MB':>10} {'peak MB':>8} "
              f"{'peak-before':>11} {'seconds':>8}")
        for length, examples in runs:
            docs = Path(tmp) / f"docs{length}_{examples}.jsonl"
            write_docs(docs, tok, length, 2 * examples, seed=length)
            cmd = [sys.executable, __file__, "--child", "--tokenizer", tok, "--docs", str(docs), "--out",
                   str(Path(tmp) / f"out{length}_{examples}" / "synth"), "--length", str(length), "--examples",
                   str(examples)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.splitlines()[-1])
            n = sum(res["examples"].values())
            print(f"{length:>8} {n:>8} {res['tokens']:>10} {res['longest']:>8} {res['before_mb']:>10.1f} "
                  f"{res['peak_mb']:>8.1f} {res['peak_mb'] - res['before_mb']:>11.1f} {res['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
