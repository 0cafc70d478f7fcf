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


def test_a_step_without_targets_logs_no_other_steps_loss(data: Data, tmp_path: Path) -> None:
    """The first iteration trains, the second has no target (the text weight is 0 at step 1), the next two train.

    With ``--log-interval 1`` the second line shows no loss (Megatron 0.19 keeps the first line's
    accumulators, so it used to show the first step's loss as its own) and every other line its own
    step's; with ``--log-interval 2`` the line of steps 1-2 averages the one step that trained and
    the line of steps 3-4 both.
    """
    flags = [*model_flags(seq=256), *train_flags(data, iters=4, mbs=1, gbs=2), "--data-path", data.sft,
             "--apertus-sft-data", data.sft, "--apertus-sft-oversize", "split",
             "--apertus-modality-weight", "text=0:1,1:0,2:1"]
    every = torchrun(flags, cwd=tmp_path)
    assert [r["no targets"] for r in every.rows] == [False, True, False, False]
    lines = {r["iteration"]: r for r in every.rows}
    assert "lm loss" not in lines[2] and "text loss" not in lines[2] and "grad norm" not in lines[2], lines[2]
    loss = every.losses()
    assert sorted(loss) == [1, 3, 4] and len(set(loss.values())) == 3, loss
    pairs = torchrun([*flags, "--log-interval", "2"], cwd=tmp_path)
    paired = pairs.losses()
    assert sorted(paired) == [1, 2, 4], paired
    assert paired[1] == paired[2] == loss[1]  # the first line previews step 1; steps 1-2 trained only step 1
    assert abs(paired[4] - (loss[3] + loss[4]) / 2) <= 2e-6 * abs(paired[4])
