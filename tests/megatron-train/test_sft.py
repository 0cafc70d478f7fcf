"""SFT through ``apertus-megatron`` on a prefix written by ``apertus tokenize sft``.

Conversations are packed best-fit-decreasing with cross-document masking; the loss mask is derived
from the ids on the fly, or read from the stored mask stream (``--apertus-sft-mask stored``): the
two runs must log the same losses. Some conversations have no assistant turn, so some samples hold
no target at all: such a step must say so in the log, count as skipped, and leave the parameters
unchanged (no update from a zero gradient), while every other step logs its ``lm loss``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Data, Run, assert_trained, model_flags, torchrun, train_flags

ITERS = 10


def sft_args(data: Data, *extra: str) -> list[str]:
    return [*model_flags(seq=128), *train_flags(data, iters=ITERS, mbs=1, gbs=1), "--data-path", data.sft,
            "--apertus-sft-data", data.sft, "--apertus-sft-oversize", "split", "--apertus-manifest",
            str(data.sft_manifest), "--log-params-norm", *extra]


@pytest.fixture(scope="module")
def derived(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return torchrun(sft_args(data), cwd=tmp_path_factory.mktemp("sft"))


def test_sft_mask_derived_and_stored(data: Data, derived: Run, tmp_path: Path) -> None:
    stored = torchrun(sft_args(data, "--apertus-sft-mask", "stored"), cwd=tmp_path)
    assert_trained(derived, ITERS, keys=("lm loss", "text loss"))
    assert_trained(stored, ITERS, keys=("lm loss", "text loss"))
    assert derived.losses() == stored.losses() and len(derived.losses()) >= 3
    assert "packed best-fit-decreasing" in derived.log
    print("SFT lm loss:", derived.losses())


def test_steps_without_targets_are_reported_and_skipped(derived: Run) -> None:
    run = derived
    empty = [r for r in run.rows if r["no targets"]]
    trained = [r for r in run.rows if not r["no targets"]]
    assert empty and trained, run.log[-3000:]
    for r in trained:  # every step with targets logs its loss and a gradient
        assert "lm loss" in r and r.get("grad norm", 0.0) > 0.0, r
    prev = {r["iteration"]: r for r in run.rows}
    for r in empty:
        # no loss, no gradient norm, no parameter change (params norm as before the step)
        assert "lm loss" not in r and "grad norm" not in r, r
        before = prev.get(r["iteration"] - 1)
        if before is not None and "params norm" in before:
            assert r["params norm"] == before["params norm"], (before, r)
    count = run.log.count("the global batch holds no loss target")
    assert count == len(empty) and f"({len(empty)} step(s) without targets so far)" in run.log


def test_empty_steps_error(data: Data, tmp_path: Path) -> None:
    run = torchrun(sft_args(data, "--apertus-empty-steps", "error"), cwd=tmp_path, check=False)
    assert run.returncode != 0
    assert "holds no loss target" in run.log and "--apertus-empty-steps error" in run.log
