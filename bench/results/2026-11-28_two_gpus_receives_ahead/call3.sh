#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), PCIe only: the two-GPU NCCL tests not yet run this session (every schedule
# with offload, the tied matrices), then the 7B row with the optimizer's default threads against 8 a rank
# (does the host AdamW slow the main thread's launches?). Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
export PYTHONUNBUFFERED=1 NCCL_P2P_DISABLE=1
. bench/wheels_env.sh "$out/a/install.log"
git log -1 --format=%H > "$out/a/commit.txt" 2>/dev/null
timeout 265 python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider --timeout 200 \
  "tests/gpu/test_gpu.py::test_every_schedule_runs_under_nccl[offload-2]" tests/gpu/test_gpu_tied.py \
  > "$out/a/pytest.txt" 2>&1
echo "tests rc $? at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
pkill -9 -f main.py 2>/dev/null; sleep 1
l=$(( 455 - ($(date +%s) - t0) ))
[ "$l" -gt 100 ] && timeout "$l" python3 bench/offload_bench.py --gpus 2 --schedule 1f1b --iterations 6 --warmup 2 \
  --budget_s $(( l - 5 )) --row_timeout_s 110 --out "$out/a/rows" \
  --rows 'pcie48-hybrid/s16,pcie48-hybrid/s16~optimizer_threads=8' > "$out/a/rows.txt" 2>&1
echo "rows done at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
find "$out/a" -name "*.lock" -delete
tail -n 4 "$out/a/rows.txt"; grep -hE "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/a/pytest.txt" | tail -8
cat "$out/a/session.txt"
cd "$out" && tar czf call3.tgz a && rm -rf a
