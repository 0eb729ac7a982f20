#!/usr/bin/env bash
# Device call 4 (issue 13 after the one-channel-per-rank-pair fix): every schedule under NCCL
# (tests/test_gpu.py, resident and offload), the tied-embedding NCCL test, then the full-7B
# bench rows of 1f1b, gpipe and interleaved back to back.   OUT=... bash bench/results/2026-11-23_7b_two_gpus_schedules_after_p2p_fix/call4.sh
set -u
out=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1; t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site || exit 1
clean() { pkill -9 -f "main.py" 2>/dev/null; pkill -9 -f "torch.distributed.run" 2>/dev/null; sleep 2; }
at() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
NCCL_P2P_DISABLE=1 timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -k every_schedule > "$out/gpu_tests.txt" 2>&1
at "gpu every_schedule rc=$?"; tail -3 "$out/gpu_tests.txt"; clean
NCCL_P2P_DISABLE=1 timeout 70 python3 -m pytest -q -m gpu tests/test_tied.py -k nccl >> "$out/gpu_tests.txt" 2>&1
at "gpu tied rc=$?"; tail -2 "$out/gpu_tests.txt"; clean
run_row() {  # schedule rows budget
  timeout $(( $3 + 10 )) python3 bench/offload_bench.py --out "$out/b_$1" --gpus 2 --iterations 4 --warmup 2 --schedule $1 \
    --checkpointing --rows "$2" --budget_s $3 --row_timeout_s 100 >> "$out/bench.txt" 2>&1
  at "bench $1 $2 rc=$?"; grep -E "^\| (pcie|row)" "$out/bench.txt" | tail -3; clean
}
run_row 1f1b pcie140-resident 100
run_row gpipe pcie140-resident 90
run_row 1f1b pcie48-hybrid/s16 100
left=$(( 540 - ($(date +%s) - t0) )); [ $left -gt 100 ] && left=100
[ $left -ge 60 ] && run_row interleaved pcie48-hybrid/s16 $left
tar czf "$out/rows.tgz" -C "$out" $(cd "$out" && ls -d b_*) && rm -rf "$out"/b_*
at done
