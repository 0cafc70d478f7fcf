#!/usr/bin/env bash
# GPU check of verl's Megatron strategy on Apertus 1.5 (prepared; NOT yet run on a GPU). One command, a few
# minutes on one GPU (Python 3.12; `pip install "apertus-plugins[bridge,verl]"`, i.e. megatron-bridge 0.6.x with
# its CUDA stack, Transformer Engine included, verl 0.9.x, transformers 5.8-5.10):
#   [MODEL=/path/to/apertus1p5/checkpoint] bash benchmarks/gpu/verl_megatron.sh
# 1. Megatron-Bridge alone: AutoBridge.from_hf_pretrained($MODEL) with the Apertus bridge, the provider's
#    model on the GPU (Transformer Engine layer spec), its forward, and export_hf_weights compared with the
#    checkpoint tensor by tensor (prints the number that differ; expected 0).
# 2. Two offline DPO steps through verl's entry point with the preset apertus_offline_dpo_megatron
#    (model_engine=megatron: verl's Megatron engine loads the checkpoint through AutoBridge; the bridge is
#    registered in every worker by actor_rollout_ref.model.external_lib), at TP1 on the one GPU, then the
#    same two steps with apertus_offline_dpo (FSDP2): the printed `dpo_loss` of step 1 (before any update)
#    should agree (same weights, same batch) to float tolerance.
# 3. With DATA=/path/to/prompts.parquet (verl format, as benchmarks/gpu/verl_stages.sh): two SDPO and two
#    online DPO steps with apertus_sdpo_megatron and apertus_online_dpo_megatron (vLLM rollouts fed by the
#    Megatron actor's weights; a judge vLLM server of $MODEL on port $PORT, default 8011).
# MODEL defaults to a tiny random Apertus 1.5 checkpoint in the released layout (`apertus make-checkpoint`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/verl_common.sh"
default_model
python - "$MODEL" <<'PY'  # one process: the provider initializes torch.distributed (nccl) itself
import sys, torch, megatron_patches.bridge  # noqa: F401  (registers the Apertus bridge)
from megatron.bridge import AutoBridge
from safetensors.torch import load_file
from megatron_patches.convert import read_hf_checkpoint
path = sys.argv[1]
bridge = AutoBridge.from_hf_pretrained(path)
provider = bridge.to_megatron_provider(load_weights=True)
provider.finalize()
model = provider.provide_distributed_model(wrap_with_ddp=False)
m = model[0].eval()
ids = torch.arange(1, 33, device="cuda")[None]
with torch.no_grad():
    logits = m(ids, torch.arange(32, device="cuda")[None], None)
print("layer spec:", type(m.decoder.layers[0].mlp).__name__, type(m.decoder.layers[0].self_attention.linear_qkv).__name__,
      "logits", tuple(logits.shape), "finite", bool(torch.isfinite(logits).all()))
original, _, _ = read_hf_checkpoint(path)
exported = {k: v.cpu() for k, v in bridge.export_hf_weights(model, cpu=True)}
differ = [k for k, v in original.items() if k not in exported or exported[k].dtype != v.dtype or not torch.equal(exported[k], v)]
print(f"export: {len(exported)} tensors, {len(original)} in the checkpoint, {len(differ)} differ", differ[:5])
PY
PAIRS=$(mktemp --suffix=.jsonl)
for i in $(seq 1 16); do
  printf '{"prompt": "What is %d plus %d?", "chosen": "It is %d.", "rejected": "I do not know."}\n' "$i" "$i" "$((2 * i))"
done > "$PAIRS"
common=(actor_rollout_ref.model.path="$MODEL" apertus.offline_dpo.pair_file="$PAIRS" apertus.offline_dpo.max_length=512
  data.train_batch_size=8 trainer.n_gpus_per_node=1 trainer.nnodes=1
  trainer.total_training_steps=2 trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
  trainer.logger='[console]' actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4)
one_gpu=(actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1)  # the presets' TP2 is the 8B's (Table G.1)
time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_offline_dpo_megatron \
  "${common[@]}" "${one_gpu[@]}" 2>&1 | tee /tmp/verl_megatron.log
time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_offline_dpo "${common[@]}" \
  2>&1 | tee /tmp/verl_fsdp.log
grep -ho "dpo_loss[^ ]*" /tmp/verl_megatron.log | head -2 | sed 's/^/megatron: /'
grep -ho "dpo_loss[^ ]*" /tmp/verl_fsdp.log | head -2 | sed 's/^/fsdp2:    /'
[ -n "${DATA:-}" ] || { echo "DATA not set: SDPO and online DPO with the Megatron presets skipped"; exit 0; }
start_judge
rollout=(actor_rollout_ref.model.path="$MODEL" data.train_files="$DATA" data.val_files="$DATA"
  apertus.judge.base_url="http://127.0.0.1:$PORT/v1" apertus.judge.charter="${CHARTER:-@sample}"
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=2 trainer.val_before_train=false
  trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger='[console]' data.max_prompt_length=512
  data.max_response_length=256 data.train_batch_size=8 actor_rollout_ref.rollout.n=4
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4)
for stage in sdpo online_dpo; do
  time python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name="apertus_${stage}_megatron" \
    "${rollout[@]}" "${one_gpu[@]}" 2>&1 | tee "/tmp/verl_megatron_${stage}.log"
done
