#!/usr/bin/env bash
# Device call 3: the 1F1B row of issue 13 and the gpipe row back to back, then every schedule
# under NCCL (tests/test_gpu.py), with the stream-ordered allocator and connected channels.
set -u
out=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1
clean() { pkill -9 -f "main.py" 2>/dev/null; pkill -9 -f "torch.distributed.run" 2>/dev/null; sleep 2; }
for s in 1f1b gpipe; do
  timeout 100 python3 bench/offload_bench.py --out "$out/b_$s" --gpus 2 --iterations 3 --warmup 2 --schedule $s \
    --checkpointing --rows pcie140-resident --budget_s 95 --row_timeout_s 92 > "$out/bench_$s.txt" 2>&1
  echo "bench $s rc=$?"; grep -E "^\| pcie" "$out/bench_$s.txt" | head -2
  grep -aE "^step|error|Watchdog caught" "$out/b_$s/pcie140-resident.log" | head -6; clean
done
NCCL_P2P_DISABLE=1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "every_schedule and resident-2" > "$out/gpu_resident.txt" 2>&1
echo "gpu test resident rc=$?"; tail -2 "$out/gpu_resident.txt"; clean
NCCL_P2P_DISABLE=1 timeout 100 python3 -m pytest -q -m gpu tests/test_gpu.py -k "every_schedule and offload-2" > "$out/gpu_offload.txt" 2>&1
echo "gpu test offload rc=$?"; tail -2 "$out/gpu_offload.txt"
