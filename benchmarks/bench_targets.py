#!/usr/bin/env python3
"""Cost of the loss targets beside the data read, on one core (SPEC.md 4.1, 4.2).

Prints, for one run on the same data:

* the time to read one sample (``--seq-length`` tokens) from a memory-mapped Megatron indexed
  dataset, warm (pages cached) and cold (the file's pages evicted with ``posix_fadvise`` first, as
  for a corpus larger than memory);
* the time to derive the SFT mask of that sample (target: at most a quarter of the read);
* the Goldfish throughput in labels per second for both variants (target: >= 20 million/s);
* the best-fit-decreasing time for 10 million document lengths into 16,384-token bins (< 10 s).

Usage: ``python benchmarks/bench_targets.py [--docs 10000000] [--seq-length 16384]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from apertus_plugins.core.goldfish import goldfish_drop, goldfish_table  # noqa: E402
from apertus_plugins.core.packing import best_fit_decreasing  # noqa: E402
from apertus_plugins.core.targets import sft_mask  # noqa: E402
from apertus_plugins.core.vocab import VocabSpec, default_spec  # noqa: E402
from apertus_plugins.data.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402


def best_of(fn: Callable[[], object], repeat: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def conversations(spec: VocabSpec, rng: np.random.Generator, n_tokens: int) -> np.ndarray:
    """Chat-shaped token stream: system, user, assistant turns with thinking and tool outputs."""
    I = spec.id  # noqa: E741
    out: list[int] = []
    while len(out) < n_tokens:
        out += [I("bos"), I("system_start"), I("system_end"), I("developer_start"), 300, I("developer_end")]
        for _ in range(int(rng.integers(1, 5))):
            out += [I("user_start"), *rng.integers(75, spec.text_size, int(rng.integers(10, 400))).tolist(),
                    I("user_end"), I("assistant_start"), I("inner_prefix"),
                    *rng.integers(75, spec.text_size, int(rng.integers(10, 300))).tolist(), I("inner_suffix"),
                    I("tools_prefix"), 500, I("tools_suffix"), I("tool_output_start"),
                    *rng.integers(75, spec.text_size, int(rng.integers(5, 100))).tolist(), I("tool_output_end"),
                    *rng.integers(75, spec.text_size, int(rng.integers(10, 300))).tolist(), I("assistant_end")]
        out.append(I("eos"))
    return np.array(out[:n_tokens], dtype=np.int32)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=10_000_000, help="document lengths to pack")
    ap.add_argument("--capacity", type=int, default=16_384, help="bin capacity")
    ap.add_argument("--seq-length", type=int, default=16_384, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=2048, help="samples in the dataset (default 2048: 128 MiB)")
    args = ap.parse_args()
    spec = default_spec()
    rng = np.random.default_rng(0)
    seq = args.seq_length

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "bench"
        block = conversations(spec, rng, seq * 64)
        with IndexedDatasetWriter(prefix, np.int32) as w:
            for i in range(args.samples):
                w.add_document(np.roll(block, i * 977)[:seq])
        ds = IndexedDataset(prefix)
        read = lambda i: np.array(ds[i], dtype=np.int64)  # noqa: E731 (a copy, as a data loader makes)
        warm = best_of(lambda: read(7))
        cold_times = []
        for i in rng.choice(args.samples, 32, replace=False).tolist():
            evict(prefix.with_suffix(".bin"))
            t0 = time.perf_counter()
            read(i)
            cold_times.append(time.perf_counter() - t0)
        cold = float(np.median(cold_times))
        sample = read(3)
        mask_t = best_of(lambda: sft_mask(sample, spec))
        trained = float(sft_mask(sample, spec).mean())

    goldfish_table()  # loaded once per process
    labels = rng.integers(75, spec.size, 4 << 20)  # 4 Mi labels
    gf = {v: labels.size / best_of(lambda v=v: goldfish_drop(labels, k=50, h=50, variant=v, spec=spec), 5)
          for v in ("hashtable", "order-sensitive")}
    batch = np.stack([read_row[1:] for read_row in [sample] * 8])
    gf_batch = batch.size / best_of(lambda: goldfish_drop(batch, k=50, h=50, spec=spec), 5)

    lengths = np.minimum(rng.lognormal(6.5, 1.3, args.docs).astype(np.int64) + 1, args.capacity)
    t0 = time.perf_counter()
    packing = best_fit_decreasing(lengths, args.capacity)
    bfd = time.perf_counter() - t0
    fill = lengths.sum() / (packing.num_bins * args.capacity)

    def line(name: str, value: str, target: str, ok: bool) -> None:
        print(f"{name:44s} {value:>18s}   target {target:24s} {'ok' if ok else 'MISSED'}")

    print(f"one core; sample = {seq} tokens of chat data ({trained:.0%} trained); numpy {np.__version__}")
    line("read one sample, mmap, warm page cache", f"{warm * 1e6:.1f} us", "(reference)", True)
    line("read one sample, mmap, cold (evicted)", f"{cold * 1e6:.1f} us", "(reference)", True)
    line("SFT mask of that sample", f"{mask_t * 1e6:.1f} us", f"<= cold read / 4 = {cold / 4 * 1e6:.0f} us",
         mask_t <= cold / 4)
    print(f"{'':44s} {'':18s}   (mask / warm read = {mask_t / warm:.1f}x)")
    for v, rate in gf.items():
        line(f"Goldfish {v}, 4M labels", f"{rate / 1e6:.1f} M labels/s", ">= 20 M labels/s", rate >= 20e6)
    line("Goldfish hashtable, 8 x 16k batch", f"{gf_batch / 1e6:.1f} M labels/s", ">= 20 M labels/s",
         gf_batch >= 20e6)
    line(f"BFD {args.docs:,} docs into {args.capacity}-token bins", f"{bfd:.2f} s", "< 10 s", bfd < 10)
    print(f"{'':44s} {packing.num_bins:,} bins, {fill:.4%} full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
