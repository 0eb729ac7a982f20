#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), PCIe only, the 7B job (64 x 512, 48 GiB cap), clipping 1.0 for every
# system done as a careful user would (FSDP2 and RoundPipe: the host norm on every core,
# bench/host_clip.py; DeepSpeed: its own, on the GPU): this project's row with a timeline of both
# ranks (last iteration), then every peer; nvidia-smi dmon logs both GPUs' clocks and power all along.
# Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}/a; mkdir -p "$out"
git log -1 --format=%H > "$out/commit.txt" 2>/dev/null
nvidia-smi dmon -s pucv -d 1 -o T > "$out/dmon.txt" 2>&1 &
dm=$!
GPUS=2 OURS_ROWS='pcie48-hybrid/s16+sequential' OURS_BUDGET_S=150 BENCH_ARGS='--iterations 8' \
  PEER_BUDGETS='fsdp2=120,deepspeed=110,roundpipe=170' \
  PEERS_ARGS='--grad_clip 1.0 --fsdp_micro_batches 32,16 --deepspeed_micro_batches 32,16 --roundpipe_points async:8,sync:8' \
  JIT_TIMEOUT_S=100 timeout 560 bash bench/peer_session.sh "$out" 530 > "$out/session.txt" 2>&1
kill $dm 2>/dev/null
find "$out" -name "*.lock" -delete; find "$out" -name "*.pt" -delete
tail -n 12 "$out/session.txt"
cd "$out/.." && tar czf call1.tgz a && rm -rf a
