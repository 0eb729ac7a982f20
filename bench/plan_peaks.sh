#!/usr/bin/env bash
# One device call, one GPU: what is on the GPU at the peak of long-row shapes, beside --plan's
# figure (bench/memory_at_peak.py), to check the plan's per-token terms where it and a peak differ.
#   OUT=$OUT bash bench/plan_peaks.sh            (from the project root, .whl carried)
# Environment: CASES (names below, in order; default: all), TOTAL_S [560: the whole call],
# CASE_S [170: at most per case]. llama-3b, every stage offloaded, activation_offload, bf16,
# 2 iterations: first the long-row table's own rows at 24 GiB (the stages the plan picks at 16K,
# 32K and 64K), then Llama-3B layers in few stages (a layer's terms, fast to build, no cap), then
# the 64K row as measured on 2026-11-28, segment rows, and the short hybrid row of the peer table
# (issue 30: 64 x 512 tokens, 13 stages, resident stages and kept layers as the plan picks them,
# 48 GiB; the plan is over its peak there). What comes back: summary.txt (every report),
# session.txt (each case's status and, where it failed, its log's end), peaks.tgz (reports and
# logs), traces.tgz (the allocator's histories, for --replay or torch's memory viewer).
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); total=${TOTAL_S:-560}
work=$out/peaks; mkdir -p "$work"
. bench/wheels_env.sh "$work/install.log"
base=(--config "" --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --allow_long_sequences
      --batch_size 1 --num_chunks 1 --use_offload --resident_stages 0 --activation_checkpointing
      --activation_offload --num_iterations 2 --no_save_model --no_progress_bar --overwrite --save_dir /tmp/peaks_run)
declare -A CASE=(
  [whole64k_s13]="--num_stages 13 --seq_length 65536 --gpu_memory_gb 24"
  [whole32k_s7]="--num_stages 7 --seq_length 32768 --gpu_memory_gb 24"
  [whole16k_s5]="--num_stages 5 --seq_length 16384 --gpu_memory_gb 24"
  [whole16k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 16384"
  [seg4tiled32k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 32768 --seq_chunks 4 --tiled_mlp true"
  [whole64k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 65536"
  [whole16k_l12s2]="--num_layers 12 --num_stages 2 --seq_length 16384"
  [tiled128k_l4s6]="--num_layers 4 --num_stages 6 --seq_length 131072 --tiled_mlp true"
  [whole64k_s25]="--num_stages 25 --seq_length 65536 --gpu_memory_gb 24"
  [seg4_16k_s4]="--num_stages 4 --seq_length 16384 --seq_chunks 4 --gpu_memory_gb 24"
  [seg8_64k_s7]="--num_stages 7 --seq_length 65536 --seq_chunks 8 --gpu_memory_gb 24"
  [hybrid_short]="--seq_length 512 --batch_size 64 --num_chunks 4 --num_stages 13 --resident_stages -1 --keep_layers -1 --no_activation_offload --gpu_memory_gb 48"
)
order="whole64k_s13 whole32k_s7 whole16k_s5 whole16k_l4s6 seg4tiled32k_l4s6 whole64k_l4s6 whole16k_l12s2 tiled128k_l4s6 whole64k_s25 seg4_16k_s4 seg8_64k_s7 hybrid_short"
for name in ${CASES:-$order}; do
  if [[ ! -v CASE[$name] ]]; then
    echo "$name: unknown (cases: $order)" >> "$work/session.txt"; continue
  fi
  left=$(( total - ($(date +%s) - t0) - 25 ))  # 25 s for the archives and the transfer back
  limit=$(( left < ${CASE_S:-170} ? left : ${CASE_S:-170} ))
  if [ "$limit" -lt 40 ]; then echo "$name: skipped (budget: ${left}s left)" >> "$work/session.txt"; continue; fi
  # shellcheck disable=SC2086  # the case's flags are words
  timeout "$limit" python3 bench/memory_at_peak.py --out "$work/$name.txt" --trace "$work/$name.pkl" \
    -- "${base[@]}" ${CASE[$name]} > "$work/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc at $(( $(date +%s) - t0 ))s (limit ${limit}s)" >> "$work/session.txt"
  [ $rc -ne 0 ] && tail -n 15 "$work/$name.log" | sed 's/^/    /' >> "$work/session.txt"
done
for f in "$work"/*.txt; do
  [ "$(basename "$f")" = session.txt ] || { echo "=== $(basename "$f" .txt)"; cat "$f"; echo; }
done > "$out/summary.txt"
cp "$work/session.txt" "$out/"
( cd "$out" && tar czf traces.tgz peaks/*.pkl 2>/dev/null; rm -f peaks/*.pkl; tar czf peaks.tgz peaks && rm -rf peaks )
