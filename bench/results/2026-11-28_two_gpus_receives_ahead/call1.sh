#!/usr/bin/env bash
# Two GPUs, PCIe only (nvidia-h200-x2, NCCL_P2P_DISABLE=1): the 7B row with receives posted just
# before their compute (receive_ahead 0, the old lowering) and one compute ahead (1, the default now),
# back to back, then activation_offload; then the two-GPU NCCL schedule tests, whose 16 MiB
# messages are what an early receive could hang on. Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
export PYTHONUNBUFFERED=1
. bench/wheels_env.sh "$out/a/install.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$out/a/gpus.txt"; nvidia-smi topo -m > "$out/a/topo.txt" 2>&1
git log -1 --format=%H > "$out/a/commit.txt" 2>/dev/null
timeout 330 python3 bench/offload_bench.py --gpus 2 --schedule 1f1b --iterations 6 --warmup 2 --budget_s 320 \
  --row_timeout_s 120 --out "$out/a/rows" \
  --rows 'pcie48-hybrid/s16~receive_ahead=0,pcie48-hybrid/s16~receive_ahead=1,pcie48-actoff/s16' > "$out/a/rows.txt" 2>&1
pkill -9 -f main.py 2>/dev/null; sleep 2
echo "rows done at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
left=$(( 560 - ($(date +%s) - t0) ))
NCCL_P2P_DISABLE=1 timeout "$left" python3 -m pytest -m gpu -rA --durations=0 -p no:cacheprovider \
  "tests/gpu/test_gpu.py::test_every_schedule_runs_under_nccl" > "$out/a/pytest.txt" 2>&1
echo "tests rc $? done at $(( $(date +%s) - t0 ))s" >> "$out/a/session.txt"
find "$out/a" -name "*.lock" -delete
tail -n 12 "$out/a/rows.txt"; tail -n 8 "$out/a/pytest.txt"; cat "$out/a/session.txt"
cd "$out" && tar czf call1.tgz a && rm -rf a
