"""Programs per second through the code sandbox, beside the same program run bare (no isolation).

    python3 tools/dev.py run verl python benchmarks/bench_code_sandbox.py [--programs 200]

Each program reads two integers and prints their sum (the interpreter's start dominates, as it does for
most competitive-programming solutions); "bare" is ``python3 main.py`` in a subprocess, "sandbox" the
local bubblewrap sandbox (namespaces, read-only root, prlimit), on 1 worker and on a pool of workers
(``judge_many``). The last row judges an APPS-style problem of 10 stdin/stdout cases per program (one
sandbox run per case). Prints one table; the ratio column is against bare on one worker.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apertus_plugins.posttrain.sandbox import (  # noqa: E402
    BubblewrapSandbox,
    Limits,
    default_interpreter,
    judge_many,
    parse_ground_truth,
)

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def bare(n: int, workers: int) -> float:
    python = default_interpreter()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "main.py"
        path.write_text(PROGRAM)

        def one(i: int) -> None:
            out = subprocess.run([python, str(path)], input=f"{i} 1\n", capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == str(i + 1)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(n)))
        return n / (time.perf_counter() - t0)


def sandboxed(n: int, workers: int) -> float:
    box = BubblewrapSandbox(limits=Limits(time_s=30), max_concurrent=workers)
    box.check()

    def one(i: int) -> None:
        out = box.run(PROGRAM, f"{i} 1\n")
        assert out.status == "ok" and out.stdout.strip() == str(i + 1), out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(n)))
    return n / (time.perf_counter() - t0)


def judged(n: int, workers: int, cases: int = 10) -> float:
    box = BubblewrapSandbox(limits=Limits(time_s=30), max_concurrent=workers)
    problem = parse_ground_truth({"inputs": [f"{i} {i}\n" for i in range(cases)],
                                  "outputs": [f"{2 * i}\n" for i in range(cases)]})
    t0 = time.perf_counter()
    verdicts = judge_many(box, [(PROGRAM, problem)] * n)
    assert all(v.passed for v in verdicts)
    return n * cases / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    n, w = args.programs, args.workers
    rows = [("bare python3, 1 worker", bare(n, 1)), (f"bare python3, {w} workers", bare(n, w)),
            ("sandbox, 1 worker", sandboxed(n, 1)), (f"sandbox, {w} workers", sandboxed(n, w)),
            (f"sandbox, {2 * w} workers", sandboxed(n, 2 * w)),
            (f"judge_many, 10-case problems, {w} workers (cases/s)", judged(max(1, n // 10), w))]
    base = rows[0][1]
    print(f"{n} programs, {os.cpu_count()} CPUs, interpreter {default_interpreter()}")
    print(f"{'':58s} {'programs/s':>10s} {'vs bare':>8s}")
    for name, rate in rows:
        print(f"{name:58s} {rate:10.1f} {rate / base:8.2f}")


if __name__ == "__main__":
    main()
