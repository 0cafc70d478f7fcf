"""Checkpoint, kill, resume: the losses after ``--load`` equal an uninterrupted run's (float32, same data order).

The interrupted run saves at iteration 4 and is SIGKILLed right after the save (the harness's
fault injection, as a preemption); the resumed run loads that checkpoint (model, AdEMAMix state,
scheduler, consumed samples) and trains iterations 5 to 8. Megatron's log prints losses to seven
significant digits: they must be identical to the uninterrupted run's, and so must the gradient
norms.
"""

from __future__ import annotations

from pathlib import Path

from conftest import Data, Run, cpu_env, pretrain_args, torchrun

SAVE_AT = 4


def test_resume_equals_uninterrupted(data: Data, pretrain_run: Run, tmp_path: Path) -> None:
    whole = pretrain_run
    save = tmp_path / "ckpt"
    ckpt = ["--save", str(save), "--save-interval", str(SAVE_AT), "--ckpt-format", "torch_dist"]
    killed = torchrun([*pretrain_args(data), *ckpt], cwd=tmp_path, check=False,
                      env=cpu_env(APERTUS_TEST_KILL_AFTER_CHECKPOINT=str(SAVE_AT)))
    assert killed.returncode != 0 and "killing rank" in killed.log, killed.log[-3000:]
    assert max(killed.losses()) == SAVE_AT
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_AT)
    resumed = torchrun([*pretrain_args(data), *ckpt, "--load", str(save)], cwd=tmp_path)
    assert sorted(resumed.losses()) == list(range(SAVE_AT + 1, max(whole.losses()) + 1)), resumed.log[-3000:]
    # every line is its own interval's (here: its own step's), the resumed run's first and second included
    for key in ("lm loss", "text loss", "omni loss"):
        got, want = resumed.losses(key), {i: v for i, v in whole.losses(key).items() if i > SAVE_AT}
        assert got == want, key
    # the gradient norm is per step: equal at every resumed iteration
    assert resumed.losses("grad norm") == {i: v for i, v in whole.losses("grad norm").items() if i > SAVE_AT}
    assert {i: v for i, v in whole.losses().items() if i <= SAVE_AT} == killed.losses()
    print("resumed lm loss:", resumed.losses(), "uninterrupted:", whole.losses())
