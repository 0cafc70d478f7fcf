"""Seconds per step of each verl stage on the tiny Apertus checkpoint on CPU, split by phase, one run.

Each stage runs verl's real trainer (``python -m verl.trainer.main_ppo`` with the packaged config) through
the verl-train suite's CPU harness (``tests/verl-train/cpu_run.py``), for ``--steps`` steps; the table
averages the steps after the first (which pays the first forward passes and the engine's warm-up) and
splits each step into verl's own timers:

* rollout: ``timing_s/gen`` (vLLM generation through the agent loop, and the reward loop in RLVR);
* judge: ``timing_s/judge`` (feedback or ratings from the judge server, teacher prompt encoding);
* ref/teacher: ``timing_s/ref`` (reference log-probs), for SDPO the teacher forward inside the update
  (``actor/sdpo_teacher_s``), for RLVR the old log-prob pass (``timing_s/old_log_prob``);
* update: ``timing_s/update_actor`` (minus the SDPO teacher), plus RLVR's advantage step;
* sync: ``timing_s/update_weights`` (the new weights into the rollout engine);
* other: the rest of ``timing_s/step``.

    python3 tools/dev.py run verl-train python benchmarks/bench_verl_stages.py [--steps 3] [--stages ...]

It starts two vLLM engines and a Ray cluster: run it alone on a small machine.
Batch: 2 prompts x 4 rollouts (SDPO 2 x 2; offline DPO 2 pairs), 16-token responses, float32.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "verl-train"))

import cpu_run  # noqa: E402

STAGES = ("apertus_offline_dpo", "apertus_online_dpo", "apertus_sdpo", "apertus_rlvr")


def stage_overrides(stage: str, ckpt: Path, work: Path, steps: int, judge: list[str]) -> list[str]:
    common = [f"actor_rollout_ref.model.path={ckpt}", f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
              "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={work / 'ckpts'}",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-4"]
    if stage == "apertus_offline_dpo":
        pairs = work / "pairs.jsonl"
        pairs.write_text("".join(json.dumps({"prompt": f"Question {k} " + "x" * k, "chosen": "Yes " * (1 + k % 3),
                                             "rejected": "No " * (2 + k % 4)}) + "\n" for k in range(2 * steps)))
        return [*common, f"apertus.offline_dpo.pair_file={pairs}", "data.train_batch_size=2",
                "apertus.offline_dpo.max_length=640", "data.max_prompt_length=512", "data.max_response_length=128",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    if stage == "apertus_rlvr":
        rows = [{"prompt": [{"role": "user", "content": f"Write at least {k + 3} words."}], "data_source": "ifeval",
                 "ground_truth": json.dumps({"instruction_id_list": ["length_constraints:number_words"],
                                             "kwargs": [{"relation": "at least", "num_words": 3}]})}
                for k in range(8 * steps)]
    else:
        rows = [{"prompt": [{"role": "user", "content": f"Say something about the number {k}."}]}
                for k in range(2 * steps)]
    data = cpu_run.write_prompts(work / "prompts.parquet", rows)
    n = 2 if stage == "apertus_sdpo" else 4
    micro = 1 if stage == "apertus_online_dpo" else 2
    out = [*common, f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=2",
           "data.max_prompt_length=256", "data.max_response_length=16", f"actor_rollout_ref.rollout.n={n}",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
           *cpu_run.ROLLOUT_OVERRIDES]
    if stage in ("apertus_sdpo", "apertus_online_dpo"):
        out += judge
    if stage == "apertus_rlvr":
        out += ["algorithm.filter_groups.enable=false"]  # every group trains: the step's cost, not the refills
    return out


def split(stage: str, steps: dict[int, dict]) -> dict[str, float]:
    later = [d for s, d in sorted(steps.items()) if s > 1] or list(steps.values())

    def mean(key: str) -> float:
        return sum(float(d.get(key, 0.0)) for d in later) / len(later)

    teacher = mean("actor/sdpo_teacher_s")
    row = {
        "step": mean("timing_s/step"),
        "rollout": mean("timing_s/gen"),
        "judge": mean("timing_s/judge"),
        "ref/teacher": mean("timing_s/ref") + teacher + (mean("timing_s/old_log_prob") if stage == "apertus_rlvr" else 0),
        "update": mean("timing_s/update_actor") - teacher + mean("timing_s/adv"),
        "sync": mean("timing_s/update_weights"),
    }
    row["other"] = row["step"] - sum(v for k, v in row.items() if k != "step")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    args = ap.parse_args()

    from apertus_plugins.testing.checkpoint import read_checkpoint_config, write_checkpoint
    from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

    root = Path(tempfile.mkdtemp(prefix="bench-verl-"))
    ckpt = write_checkpoint(root / "apertus-tiny", size="tiny", init="varied")
    judge_server = None
    judge: list[str] = []
    if {"apertus_sdpo", "apertus_online_dpo"} & set(args.stages):
        text = read_checkpoint_config(ckpt).spec.text_size
        judge_server = VLLMServer(ckpt, args=[*CPU_ARGS, "--dtype", "float32", "--served-model-name", "judge",
                                              "--max-logprobs", str(text), "--max-num-seqs", "8"],
                                  python=sys.executable, log_path=root / "judge.log").start()
        judge = [f"apertus.judge.base_url={judge_server.base_url}", "apertus.judge.model=judge",
                 f"+apertus.judge.top_logprobs={text}", "+apertus.judge.feedback_max_tokens=16", "apertus.judge.charter=@sample"]
    rows = {}
    try:
        for stage in args.stages:
            work = root / stage
            work.mkdir()
            run = cpu_run.main_ppo(stage, stage_overrides(stage, ckpt, work, args.steps, judge), work, timeout=1800)
            if run.returncode != 0 or len(run.steps) != args.steps:
                print(f"{stage} failed (exit {run.returncode}, {len(run.steps)} steps); log {work / 'trainer.log'}:\n"
                      f"{run.tail(30)}")
                return 1
            rows[stage] = split(stage, run.steps) | {"process": run.seconds}
    finally:
        if judge_server is not None:
            judge_server.stop()
    cols = ("step", "rollout", "judge", "ref/teacher", "update", "sync", "other")
    print(f"\nseconds per step (mean of steps 2..{args.steps}), tiny Apertus 1.5 checkpoint, CPU, one run")
    print(f"{'stage':22s}" + "".join(f"{c:>12s}" for c in cols) + f"{'process':>10s}")
    for stage, row in rows.items():
        print(f"{stage:22s}" + "".join(f"{row[c]:12.3f}" for c in cols) + f"{row['process']:10.0f}")
    print("process: wall seconds of the whole trainer process (Ray, workers, engine start-up, all steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
