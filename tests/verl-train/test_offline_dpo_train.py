"""Offline DPO through verl's real trainer: ``python -m verl.trainer.main_ppo --config-name=apertus_offline_dpo``.

Ray workers, TransferQueue, the FSDP2 actor and reference, the reference log-prob pass, the
length-normalized DPO update with the linear learning-rate schedule, checkpoints; then a resume from the
step-2 checkpoint, which must continue the data order, the schedule and the weights exactly.
No rollout engine starts (the packaged config's rollout backend is ``none``).
"""

from __future__ import annotations

import json
import math

import cpu_run
import pytest
from conftest import check_saved_checkpoint, hf_checkpoint

LR = 1e-3
STEPS = 4


#: step 1's loss is -log sigmoid(0) up to float32 rounding: the actor and the reference compute the same
#: weights' log-probabilities in micro-batches of different shapes (measured 6e-6 with torch 2.13's CPU kernels)
LOG2_TOLERANCE = 5e-5


def pairs(n: int) -> list[dict]:
    """Pairs of varied lengths; chosen always "Yes", rejected "No"."""
    return [{"prompt": [{"role": "user", "content": "Question " + "x" * (3 * k)}],
             "chosen": "Yes " * (1 + k % 3), "rejected": "No " * (2 + (5 * k) % 4)} for k in range(n)]


def overrides(checkpoint, pair_file, workdir) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={checkpoint}", f"apertus.offline_dpo.pair_file={pair_file}",
        "data.train_batch_size=2", "apertus.offline_dpo.max_length=640", "data.max_prompt_length=512",
        "data.max_response_length=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.default_local_dir={workdir / 'ckpts'}",
    ]


@pytest.fixture(scope="module")
def straight(tiny_checkpoint, tmp_path_factory):
    """Four steps in one run, checkpoints at steps 2 and 4."""
    work = tmp_path_factory.mktemp("offline-dpo")
    pair_file = work / "pairs.jsonl"
    pair_file.write_text("".join(json.dumps(p) + "\n" for p in pairs(8)))
    run = cpu_run.main_ppo("apertus_offline_dpo", overrides(tiny_checkpoint, pair_file, work), work)
    assert run.returncode == 0, run.tail()
    return run, pair_file


def test_four_steps_reference_pass_and_dpo_update(straight, tiny_checkpoint):
    run, _ = straight
    assert sorted(run.steps) == [1, 2, 3, 4]
    loss = run.metric("actor/dpo_loss")
    assert all(math.isfinite(v) for v in loss)
    # step 1: policy == reference, so each pair's loss is -log sigmoid(0) (float32 throughout)
    assert loss[0] == pytest.approx(math.log(2), abs=LOG2_TOLERANCE)
    # the reference pass ran every step and the policy learned "Yes" over "No" on pairs it had not seen
    assert all(t > 0 for t in run.metric("timing_s/ref"))
    assert max(loss[1:]) < math.log(2) - 1e-3
    assert run.metric("actor/dpo_reward_accuracy")[-1] == 1.0
    assert run.metric("dpo/pairs") == [2.0] * STEPS
    # one epoch: the four steps take every pair of the file once (their tokens add up to the file's)
    from apertus_plugins.core.chat import ChatTokenizer
    from verl_ext import dpo

    encoded = dpo.encode_pairs(pairs(8), ChatTokenizer(tiny_checkpoint), 512, 128)
    assert sum(run.metric("dpo/tokens")) == sum(p.tokens for p in encoded)
    # linear decay from the peak over the 4 steps (verl logs the rate after the scheduler's step)
    assert run.metric("actor/lr") == pytest.approx([LR * (1 - s / STEPS) for s in range(1, STEPS + 1)], rel=1e-6)
    assert all(run.metric("training/global_step")[i] == i + 1 for i in range(STEPS))
    assert "vLLMHttpServer" not in run.log  # no inference engine started


def test_resume_continues_data_order_schedule_and_weights(straight, tiny_checkpoint, tmp_path):
    run, pair_file = straight
    resumed = cpu_run.main_ppo("apertus_offline_dpo", [
        *overrides(tiny_checkpoint, pair_file, tmp_path), "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={run.workdir / 'ckpts' / 'global_step_2'}"], tmp_path)
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.steps) == [3, 4]
    straight_34 = {k: [run.steps[s][k] for s in (3, 4)] for k in ("dpo/tokens", "actor/lr", "actor/dpo_loss")}
    assert resumed.metric("dpo/tokens") == straight_34["dpo/tokens"]
    assert resumed.metric("actor/lr") == pytest.approx(straight_34["actor/lr"], rel=1e-6)
    assert resumed.metric("actor/dpo_loss") == pytest.approx(straight_34["actor/dpo_loss"], abs=1e-5)


def test_saved_checkpoint_loads_merges_and_serves(straight, tiny_checkpoint, tmp_path):
    run, _ = straight
    check_saved_checkpoint(hf_checkpoint(run.workdir, STEPS), tiny_checkpoint, tmp_path / "merged", serve=False)
