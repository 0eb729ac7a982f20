#!/usr/bin/env bash
# One device call, one GPU: what is on the GPU at the peak of the long-row shapes the memory plan
# misjudges, beside --plan's figure (bench/memory_at_peak.py), for the plan's per-token terms.
#   OUT=$OUT bash bench/plan_peaks.sh            (from the project root, .whl carried)
# Environment: CASES (default: all, in this order), TOTAL_S [560].
# Llama-3B's shapes with few layers (a layer's terms, fast to build), every stage offloaded,
# activation_offload, bf16, no cap (the peak is measured, not limited), 2 iterations; then the
# 64K row of the long-row table itself. OUT/peaks.tgz holds every report and the allocator's
# history of each case (pickles for torch's memory viewer); the reports are also left in OUT.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); total=${TOTAL_S:-560}
mkdir -p "$out/peaks"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl-site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=$PWD/.whl-site:${PYTHONPATH:-}
fi
base=(--config "" --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --allow_long_sequences
      --batch_size 1 --num_chunks 1 --use_offload --resident_stages 0 --activation_checkpointing
      --activation_offload --num_iterations 2 --no_save_model --no_progress_bar --overwrite --save_dir /tmp/peaks_run)
declare -A CASE=(
  [whole16k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 16384"
  [whole64k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 65536"
  [whole16k_l12s2]="--num_layers 12 --num_stages 2 --seq_length 16384"
  [seg4tiled32k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 32768 --seq_chunks 4 --tiled_mlp true"
  [tiled128k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 131072 --tiled_mlp true"
  [whole64k_s25]="--num_stages 25 --seq_length 65536 --gpu_memory_gb 24"
)
for name in ${CASES:-whole16k_l4s6 whole64k_l4s6 whole16k_l12s2 seg4tiled32k_l4s6 tiled128k_l4s6 whole64k_s25}; do
  left=$(( total - ($(date +%s) - t0) - 20 ))
  [ "$left" -lt 40 ] && { echo "$name: skipped (budget: ${left}s left)" | tee -a "$out/peaks/session.txt"; continue; }
  # shellcheck disable=SC2086
  timeout "$left" python3 bench/memory_at_peak.py --out "$out/peaks/$name.txt" --trace "$out/peaks/$name.pkl" \
    -- "${base[@]}" ${CASE[$name]} > "$out/peaks/$name.log" 2>&1
  echo "$name: rc $? at $(( $(date +%s) - t0 ))s" | tee -a "$out/peaks/session.txt"
done
cp "$out"/peaks/*.txt "$out/" 2>/dev/null
tar czf "$out/peaks.tgz" -C "$out" peaks && rm -rf "$out/peaks"
