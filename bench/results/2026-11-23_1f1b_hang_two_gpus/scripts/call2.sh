#!/usr/bin/env bash
set -u
out=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
NCCL_P2P_DISABLE=1 timeout 330 python3 -m pytest -q -m gpu tests/test_gpu.py -k "every_schedule" -x > "$out/gpu_schedules.txt" 2>&1
echo "gpu schedule test rc=$?"; tail -3 "$out/gpu_schedules.txt"
for s in 1f1b gpipe; do
  timeout 150 python3 bench/offload_bench.py --out "$out/bench_$s" --gpus 2 --iterations 5 --warmup 2 --schedule $s \
    --checkpointing --rows pcie140-resident --budget_s 140 > "$out/bench_$s.txt" 2>&1
  echo "bench $s rc=$?"; grep -E "^\| pcie" "$out/bench_$s.txt" | head -3
done
