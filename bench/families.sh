#!/usr/bin/env bash
# One device call (one GPU): the families issue's rows. Qwen3-4B's shapes and a small Qwen3-MoE
# (presets qwen3-4b, qwen3-moe-small; random weights) on the short-sequence job (batch 64 x 512,
# bf16 with fp32 AdamW, activation checkpointing, clipping 1.0, a 48 GiB cap): per model, this
# project's hybrid row (bench/offload_bench.py), then RoundPipe's Qwen3 / Qwen3-MoE preset
# (bench/peers.py), back to back; one table per model in OUT/<model>/peers.md (model TFLOP/s =
# 6 x active parameters x tokens / s). First, if GPU_TESTS=1, the families' bf16 GPU test, while
# RoundPipe's CPU Adam compiles in the background.
#   OUT=... bash bench/families.sh        (project root, .whl carried: wheels.sh + peer_wheels.sh)
# Environment (defaults in brackets): MODELS [qwen3-4b,qwen3-moe-small], OURS [1: this project's
# rows], STAGES [qwen3-4b=12 qwen3-moe-small=6], OURS_S [150: a row's budget], RP_S [150: RoundPipe's
# budget per model], RP_POINTS [async:8,sync:8], GPU_TESTS [1], TESTS_S [120].
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out"
export PYTHONUNBUFFERED=1
. bench/wheels_env.sh "$out/install.log"
# RoundPipe's CPU Adam, built in the background (bench/roundpipe_adam.py)
( timeout 150 python3 bench/roundpipe_adam.py >"$out/jit_roundpipe.log" 2>&1 ) &
jit=$!
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # -k: an in-process trainer takes SIGTERM as "stop after this step", so timeout must be able to kill
  timeout -k 10 "${TESTS_S:-120}" python3 -m pytest -q -m gpu tests/one_process/test_families.py -p no:logging -o faulthandler_timeout=60 \
    --durations=0 ${TESTS_K:+-k "$TESTS_K"} >"$out/gpu_tests.log" 2>&1
  echo "gpu tests rc $? at $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log"
fi
wait $jit; tail -n 1 "$out/jit_roundpipe.log"
declare -A stages=([qwen3-4b]=12 [qwen3-moe-small]=6)
for kv in ${STAGES:-}; do stages[${kv%%=*}]=${kv#*=}; done
for model in $(echo "${MODELS:-qwen3-4b,qwen3-moe-small}" | tr , ' '); do
  mkdir -p "$out/$model"
  if [ "${OURS:-1}" = 1 ]; then
    python3 bench/offload_bench.py --gpus 1 --model "$model" --rows "pcie48-hybrid/s${stages[$model]}@$model" \
      --schedule 1f1b --iterations 4 --warmup 2 --budget_s "${OURS_S:-150}" --row_timeout_s "${OURS_S:-150}" \
      --out "$out/$model/bench" >"$out/$model/ours.log" 2>&1
  fi
  python3 bench/peers.py --gpus 1 --out "$out/$model" --ours "$out/$model/bench" --budget_s "${RP_S:-150}" \
    --peers roundpipe --peer_budgets "roundpipe=${RP_S:-150}" --model "$model" \
    --roundpipe_points "${RP_POINTS:-async:8,sync:8}" >"$out/$model/peers.log" 2>&1
  echo "== $model done at $(( $(date +%s) - t0 ))s"
  cat "$out/$model/peers.md" 2>/dev/null || tail -n 20 "$out/$model/peers.log"
done
tar czf "$out/families.tgz" -C "$out" --exclude='*.pt' --exclude='*.safetensors' . 2>/dev/null
