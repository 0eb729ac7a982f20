#!/usr/bin/env bash
# Variants of the 1F1B GPU hang (issue 13), each bounded; logs go to $OUT/dl_<name>.log
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_P2P_DISABLE=1
run() {  # name layers schedule env... -- extra flags
  local name=$1 layers=$2 sched=$3; shift 3
  local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift || true
  echo "== $name: layers=$layers $sched ${envs[*]} $*"; local t0=$(date +%s)
  env "${envs[@]}" PROBE_DUMP_S=${DUMP_S:-35} timeout ${RUN_TIMEOUT:-110} python3 -m torch.distributed.run --standalone \
    --nproc_per_node 2 bench/results/2026-11-23_1f1b_hang_two_gpus/scripts/hang_probe.py --config "" --model llama-2-7b --num_layers "$layers" --dataset synthetic \
    --seq_length 512 --batch_size 64 --num_chunks 16 --num_stages 8 --num_iterations ${ITERS:-3} --gpu_memory_gb 140 \
    --device cuda --no_save_model --activation_checkpointing --no_offload --grad_clip 1.0 --comm_timeout_s 45 \
    --schedule "$sched" --save_dir "/tmp/dl_$name" --save_results "/tmp/dl_$name/results.json" "$@" > "$out/dl_$name.log" 2>&1
  local rc=$?
  echo "rc=$rc wall=$(( $(date +%s) - t0 ))s"; grep -aE "^step|it/s|s/step|error|Timeout|iteration [0-9]" "$out/dl_$name.log" | head -6
  return $rc
}
