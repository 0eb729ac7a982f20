#!/usr/bin/env bash
# One device call (one GPU): the families issue's rows. Qwen3-4B's shapes and a small Qwen3-MoE
# (presets qwen3-4b, qwen3-moe-small; random weights) on the short-sequence job (batch 64 x 512,
# bf16 with fp32 AdamW, activation checkpointing, clipping 1.0, a 48 GiB cap): this project's
# hybrid row, then RoundPipe's Qwen3 / Qwen3-MoE preset, back to back per model, each in
# bench/peer_session.sh (one table per model: OUT/<model>/peers.md, model TFLOP/s = 6 x active
# parameters x tokens / s). First, if GPU_TESTS=1, the families' bf16 GPU test.
#   OUT=... bash bench/families.sh        (project root, .whl carried: wheels.sh + peer_wheels.sh)
# Environment (defaults in brackets): MODELS [qwen3-4b,qwen3-moe-small], STAGES [qwen3-4b=12,
# qwen3-moe-small=6], MODEL_S [240: each model's session], OURS_BUDGET_S [110],
# RP_POINTS [async:8,sync:8], GPU_TESTS [1], TESTS_S [150].
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl-site .whl/*.whl \
  >"$out/install.log" 2>&1 || tail -5 "$out/install.log"
export PYTHONPATH=$PWD/.whl-site:${PYTHONPATH:-}
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu tests/test_families.py -x >"$out/gpu_tests.log" 2>&1
  echo "gpu tests rc $? at $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_tests.log")"
fi
declare -A stages=([qwen3-4b]=12 [qwen3-moe-small]=6)
for kv in ${STAGES:-}; do stages[${kv%%=*}]=${kv#*=}; done
for model in $(echo "${MODELS:-qwen3-4b,qwen3-moe-small}" | tr , ' '); do
  GPUS=1 OURS_ROWS="pcie48-hybrid/s${stages[$model]}@$model" OURS_BUDGET_S=${OURS_BUDGET_S:-110} \
    BENCH_ARGS="--schedule 1f1b --model $model" PEERS=roundpipe PEER_BUDGETS=roundpipe=$(( ${MODEL_S:-240} - ${OURS_BUDGET_S:-110} - 15 )) \
    PEERS_ARGS="--model $model --roundpipe_points ${RP_POINTS:-async:8,sync:8}" JIT_TIMEOUT_S=60 \
    timeout $(( ${MODEL_S:-240} + 20 )) bash bench/peer_session.sh "$out/$model" "${MODEL_S:-240}" >"$out/$model.log" 2>&1
  echo "== $model done at $(( $(date +%s) - t0 ))s"
  cat "$out/$model/peers.md" 2>/dev/null || tail -n 20 "$out/$model.log"
done
