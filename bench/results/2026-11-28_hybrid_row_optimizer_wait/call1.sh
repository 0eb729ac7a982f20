#!/usr/bin/env bash
# Issue 30, one GPU: the short hybrid row (llama-3b, 64 x 512, 48 GiB cap, clip 1.0) with 4 micro-batches
# waits ~0.3-0.5 s a step for the host AdamW of its offloaded stages. Which of resident count,
# partition and micro-batches hides it best, each row with its timeline; then the default row's profile.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
source bench/wheels_env.sh "$out/a/install.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$out/a/gpus.txt"
lscpu > "$out/a/lscpu.txt"
R='pcie48-hybrid/s13+sequential@llama-3b~num_chunks=4'   # +sequential: one GPU's mapping, with --timeline
ROWS="$R,$R~partition=layers,$R~resident_stages=6,$R~partition=layers~resident_stages=6"
ROWS="$ROWS,pcie48-hybrid/s13+sequential@llama-3b~num_chunks=8~resident_stages=7"
timeout 430 python3 bench/offload_bench.py --gpus 1 --model llama-3b --schedule 1f1b --iterations 7 --warmup 2 \
  --budget_s 420 --row_timeout_s 110 --rows "$ROWS" --out "$out/a/bench" > "$out/a/bench.txt" 2>&1
pkill -9 -f main.py 2>/dev/null; sleep 2
echo "rows done at $(( $(date +%s) - t0 ))s" >> "$out/a/bench.txt"
left=$(( 585 - ($(date +%s) - t0) ))
[ "$left" -gt 60 ] && timeout $(( left - 5 )) python3 bench/profile_step.py --out "$out/a/profile" --warmup 4 -- \
  --model llama-3b --dataset synthetic --seq_length 512 --batch_size 64 --num_chunks 4 --num_stages 13 \
  --schedule 1f1b --gpu_memory_gb 48 --device cuda --activation_checkpointing --use_offload --use_prefetch \
  --resident_stages -1 --keep_layers -1 --grad_clip 1.0 > "$out/a/profile.txt" 2>&1
rm -f "$out/a/profile/trace.json"; find "$out/a" -name "*.lock" -delete
cat "$out/a/bench/table.md" 2>/dev/null; tail -3 "$out/a/bench.txt"; cat "$out/a/profile/profile.md" 2>/dev/null
cd "$out" && tar czf all.tgz a && rm -rf a
