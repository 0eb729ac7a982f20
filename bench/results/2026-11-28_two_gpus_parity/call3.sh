#!/usr/bin/env bash
# One GPU of nvidia-h200-x2 (32 cores), the short-row job: llama-3b, 64 x 512, 48 GiB cap, clipping
# 1.0 for every system done as a careful user would (FSDP2 and RoundPipe: the host norm on every core,
# bench/host_clip.py; DeepSpeed: its own, on the GPU): the README row, then every peer at the
# points that won its earlier sweeps and one more. Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}/a; mkdir -p "$out"
git log -1 --format=%H > "$out/commit.txt" 2>/dev/null
GPUS=1 OURS_ROWS='pcie48-hybrid/s13@llama-3b~num_chunks=4' OURS_BUDGET_S=100 BENCH_ARGS='--iterations 7' \
  PEERS=roundpipe,fsdp2,deepspeed PEER_BUDGETS='roundpipe=150,fsdp2=115,deepspeed=115' \
  PEERS_ARGS='--model llama-3b --grad_clip 1.0 --fsdp_micro_batches 32,16 --deepspeed_micro_batches 32,16 --roundpipe_points async:8,sync:8' \
  JIT_TIMEOUT_S=100 timeout 570 bash bench/peer_session.sh "$out" 545 > "$out/session.txt" 2>&1
find "$out" -name "*.lock" -delete; find "$out" -name "*.pt" -delete
tail -n 9 "$out/session.txt"
cd "$out/.." && tar czf call3.tgz a && rm -rf a
