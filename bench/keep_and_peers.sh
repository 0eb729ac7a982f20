#!/usr/bin/env bash
# One device call: this project's 1F1B hybrid row with keep_layers 0, then (bench/peer_session.sh)
# OURS_ROWS with keep_layers auto and PEERS back to back, on GPUS GPUs.
#   OUT=... bash bench/keep_and_peers.sh        (from the project root, .whl carried)
# Environment (defaults in brackets): GPUS [2], KEEP0 [1: run KEEP0_ROWS [pcie48-hybrid/s16] with
# keep_layers 0 first],
# OURS_ROWS [pcie48-hybrid/s16], PEERS [fsdp2,roundpipe], PEER_BUDGETS [fsdp2=80,roundpipe=300],
# PEERS_ARGS [--fsdp_micro_batches 32,16 --roundpipe_points async:8,sync:8,async:4,sync:4],
# ROW_S [75: the keep_layers 0 row's limit], TOTAL_S [585: the whole call].
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
gpus=${GPUS:-2}; row_s=${ROW_S:-75}; total=${TOTAL_S:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl >/dev/null 2>&1
if [ "${KEEP0:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site timeout $(( row_s + 5 )) python3 bench/offload_bench.py --gpus "$gpus" \
    --rows "${KEEP0_ROWS:-pcie48-hybrid/s16}" --schedule 1f1b --keep_layers 0 --iterations 5 --warmup 2 \
    --budget_s "$row_s" --row_timeout_s "$row_s" --out "$out/a/bench_keep0" > "$out/session.txt" 2>&1
  pkill -9 -f "main.py" 2>/dev/null; sleep 2
  echo "keep0 rows done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
fi
GPUS=$gpus OURS_ROWS=${OURS_ROWS:-pcie48-hybrid/s16} OURS_BUDGET_S=${OURS_BUDGET_S:-75} BENCH_ARGS='--schedule 1f1b' \
  PEERS=${PEERS:-fsdp2,roundpipe} PEER_BUDGETS=${PEER_BUDGETS:-fsdp2=80,roundpipe=300} \
  PEERS_ARGS=${PEERS_ARGS:---fsdp_micro_batches 32,16 --roundpipe_points async:8,sync:8,async:4,sync:4} \
  timeout $(( total - ($(date +%s) - t0) )) bash bench/peer_session.sh "$out/a" $(( total - 10 - ($(date +%s) - t0) )) \
  >> "$out/session.txt" 2>&1
echo "done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
