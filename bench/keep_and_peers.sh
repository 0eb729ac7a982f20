#!/usr/bin/env bash
# One device call: this project's 1F1B hybrid row with keep_layers 0, then with keep_layers auto,
# FSDP2 (fused CPU AdamW) and RoundPipe (both step modes) back to back.
#   OUT=... bash bench/keep_and_peers.sh        (from the project root, .whl carried)
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl >/dev/null 2>&1
PYTHONPATH=/tmp/site timeout 80 python3 bench/offload_bench.py --gpus 2 --rows pcie48-hybrid/s16 --schedule 1f1b \
  --keep_layers 0 --iterations 5 --warmup 2 --budget_s 75 --row_timeout_s 75 --out "$out/a/bench_keep0" > "$out/session.txt" 2>&1
pkill -9 -f "main.py" 2>/dev/null; sleep 2
echo "keep0 row done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
OURS_ROWS=pcie48-hybrid/s16 OURS_BUDGET_S=75 BENCH_ARGS='--schedule 1f1b' PEERS=fsdp2,roundpipe \
  PEER_BUDGETS=fsdp2=80,roundpipe=300 PEERS_ARGS='--fsdp_micro_batches 32,16 --roundpipe_points async:8,sync:8,async:4,sync:4' \
  timeout $(( 585 - ($(date +%s) - t0) )) bash bench/peer_session.sh "$out/a" $(( 575 - ($(date +%s) - t0) )) >> "$out/session.txt" 2>&1
echo "done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
