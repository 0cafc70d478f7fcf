# Sourced by the verl GPU checks (verl_stages.sh, verl_megatron.sh); not a check of its own.

# MODEL, or a tiny random Apertus 1.5 checkpoint in the released layout (`apertus make-checkpoint`) when unset.
default_model() {
  if [ -z "${MODEL:-}" ]; then
    MODEL=$(mktemp -d)/apertus-tiny
    apertus make-checkpoint "$MODEL" --size tiny --init varied
  fi
}

# A vLLM server of $MODEL named `judge` on port $PORT (default 8011), log in /tmp/judge.log; returns once it
# answers, and is stopped when the calling script exits.
start_judge() {
  PORT=${PORT:-8011}
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name judge --port "$PORT" \
    --gpu-memory-utilization 0.15 --max-logprobs 20 > /tmp/judge.log 2>&1 &
  JUDGE=$!
  trap 'kill $JUDGE 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; do sleep 2; done
}
