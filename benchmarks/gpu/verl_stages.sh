#!/usr/bin/env bash
# GPU check of the verl adapter (prepared; NOT yet run on a GPU): three SDPO steps and three online
# DPO steps with vLLM rollouts, and three offline DPO steps on a small generated pair file, through
# verl's own entry point and the packaged configs, plus the SDPO loss benchmark at the full 16 x 4,096 size. One command, a few minutes on one GPU:
#   [MODEL=/path/to/apertus1p5/checkpoint] DATA=/path/to/prompts.parquet bash benchmarks/gpu/verl_stages.sh
# MODEL defaults to a tiny random Apertus 1.5 checkpoint in the released layout (`apertus make-checkpoint`),
# which verl's FSDP engine loads as Apertus1p5ForCausalLM and the vLLM rollout serves through vllm_model.
# Needs: verl 0.9.1 with vllm, transferqueue, this package installed (the verl.plugins entry point),
# and a judge endpoint: by default a vLLM server of $MODEL started here on port 8011. $MODEL carries
# the Apertus tokenizer (the trainers render prompts with the core chat template).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/verl_common.sh"
default_model
DATA=${DATA:?set DATA to a parquet of chat prompts in verl format (prompt, data_source, reward_model)}
start_judge
judge=(apertus.judge.base_url="http://127.0.0.1:$PORT/v1" apertus.judge.charter="${CHARTER:-@sample}")  # CHARTER=@/path/charter.md
common=(actor_rollout_ref.model.path="$MODEL" data.train_files="$DATA" data.val_files="$DATA"
  trainer.n_gpus_per_node=1 trainer.nnodes=1
  trainer.total_training_steps=3 trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
  trainer.logger='[console]' data.max_prompt_length=512 data.max_response_length=256
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4)
time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_sdpo "${common[@]}" "${judge[@]}" \
  data.train_batch_size=8 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=8
time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_online_dpo "${common[@]}" "${judge[@]}" \
  data.train_batch_size=8 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=8
# offline DPO: 24 pairs, 8 per step, linear LR schedule installed into verl's FSDP engine
PAIRS=$(mktemp --suffix=.jsonl)
for i in $(seq 1 24); do
  printf '{"prompt": "What is %d plus %d?", "chosen": "It is %d.", "rejected": "I do not know."}\n' "$i" "$i" "$((2 * i))"
done > "$PAIRS"
time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_offline_dpo "${common[@]}" \
  apertus.offline_dpo.pair_file="$PAIRS" apertus.offline_dpo.max_length=768 data.train_batch_size=8
python benchmarks/bench_sdpo_loss.py --device cuda --hidden 4096 --tokens 4096 16384 65536 --naive-max-tokens 65536
