"""Tensor parallelism: two processes at TP=2 give the TP=1 losses within float32 tolerance.

Both runs start from the same weights (``--use-cpu-initialization`` draws the full matrices and
splits them), read the same batches (rank 0 of the group reads, the other receives) and train
with AdEMAMix and Goldfish; the xIELU scalars' gradients are summed over the group.
"""

from __future__ import annotations

import math
from pathlib import Path

from conftest import PRETRAIN_ITERS, Data, Run, assert_trained, pretrain_args, torchrun

ITERS = PRETRAIN_ITERS


def test_tp2_equals_tp1(data: Data, pretrain_run: Run, tmp_path: Path) -> None:
    one = pretrain_run
    two = torchrun([*pretrain_args(data), "--tensor-model-parallel-size", "2"], nproc=2, cwd=tmp_path)
    assert_trained(two, ITERS)
    assert "initialized tensor model parallel with size 2" in two.log
    # the preflight ran once, on rank 0, and its verdict reached both ranks
    assert two.log.count("[apertus] preflight:") == 1 and "verdict sent to 2 rank(s)" in two.log
    for key in ("lm loss", "text loss"):
        a, b = one.losses(key), two.losses(key)
        assert a.keys() == b.keys() and len(a) == ITERS
        worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
        print(f"TP=2 vs TP=1 {key}: max relative difference {worst:.2e}")
        assert worst < 1e-5 and all(math.isfinite(v) for v in b.values()), (a, b)
