#!/usr/bin/env bash
# One device call (nvidia-h200-x2, `.whl` carried): data_parallel 2 x 1 rank against one 2-rank
# pipeline on the same job, then the tied-embedding NCCL tests.
#   OUT=... bash bench/dp_and_tied.sh
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site || exit 1
clean() { pkill -9 -f "main.py" 2>/dev/null; pkill -9 -f "torch.distributed.run" 2>/dev/null; sleep 2; }
for dp in 1 2; do
  stages=$(( 16 / dp ))  # the same stage size: 2 layers of the 7B model
  timeout 200 python3 bench/offload_bench.py --gpus 2 --data_parallel $dp --schedule 1f1b --iterations 5 --warmup 2 \
    --rows pcie48-hybrid/s$stages,pcie48-prefetch/s$stages --budget_s 190 --row_timeout_s 120 \
    --out "$out/dp$dp" > "$out/dp$dp.txt" 2>&1
  echo "[$(( $(date +%s) - t0 ))s] data_parallel $dp rc=$?"; grep -E "^\| pcie" "$out/dp$dp.txt"; clean
done
NCCL_P2P_DISABLE=1 timeout 150 python3 -m pytest -q -m gpu tests/one_process/test_tied.py -k nccl > "$out/tied.txt" 2>&1
echo "[$(( $(date +%s) - t0 ))s] tied rc=$?"; tail -2 "$out/tied.txt"
tar czf "$out/rows.tgz" -C "$out" dp1 dp2 && rm -rf "$out/dp1" "$out/dp2"
