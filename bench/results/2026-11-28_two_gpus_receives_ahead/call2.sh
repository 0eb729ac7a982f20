#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), PCIe only: the two-GPU offload test that never started (its flag builder),
# replicas on NCCL against one GPU and against one two-GPU pipeline on the 3B short rows, then the
# NCCL schedule test for as long as the call allows. Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
export PYTHONUNBUFFERED=1 NCCL_P2P_DISABLE=1
. bench/wheels_env.sh "$out/a/install.log"
git log -1 --format=%H > "$out/a/commit.txt" 2>/dev/null
left() { echo $(( 565 - ($(date +%s) - t0) )); }
timeout 170 python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider --timeout 160 \
  "tests/gpu/test_gpu.py::test_offload_prefetch_matches_resident[2]" > "$out/a/pytest_offload.txt" 2>&1
echo "offload test rc $? at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
row='pcie48-hybrid/s13@llama-3b'
timeout 95 python3 bench/offload_bench.py --gpus 1 --schedule 1f1b --iterations 6 --warmup 2 --budget_s 90 \
  --row_timeout_s 90 --out "$out/a/one_gpu" --rows "$row~num_chunks=4" > "$out/a/one_gpu.txt" 2>&1
pkill -9 -f main.py 2>/dev/null; sleep 1
timeout 95 python3 bench/offload_bench.py --gpus 2 --data_parallel 2 --schedule 1f1b --iterations 6 --warmup 2 \
  --budget_s 90 --row_timeout_s 90 --out "$out/a/replicas" --rows "$row~num_chunks=8" > "$out/a/replicas.txt" 2>&1
pkill -9 -f main.py 2>/dev/null; sleep 1
timeout 95 python3 bench/offload_bench.py --gpus 2 --schedule 1f1b --iterations 6 --warmup 2 --budget_s 90 \
  --row_timeout_s 90 --out "$out/a/pipeline" --rows 'pcie48-hybrid/s26@llama-3b~num_chunks=8' > "$out/a/pipeline.txt" 2>&1
pkill -9 -f main.py 2>/dev/null; sleep 1
echo "rows done at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
l=$(left); [ "$l" -gt 60 ] && timeout "$l" python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider \
  --timeout $(( l - 5 )) "tests/gpu/test_gpu.py::test_every_schedule_runs_under_nccl[resident-2]" \
  > "$out/a/pytest_schedules.txt" 2>&1
echo "schedule test rc $? at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
find "$out/a" -name "*.lock" -delete
for f in one_gpu replicas pipeline; do tail -n 3 "$out/a/$f.txt"; done
grep -hE "PASSED|FAILED|ERROR|passed|failed" "$out/a"/pytest_*.txt | tail -8; cat "$out/a/session.txt"
cd "$out" && tar czf call2.tgz a && rm -rf a
