#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), PCIe only, the 7B job (64 x 512, 48 GiB cap), after freezing what the
# first step builds out of the GC: the clipped row and the unclipped one (the host AdamW then overlaps
# the backward), then RoundPipe in both step modes, clipping 1.0 through the host norm on every core.
# Run from the project root with .whl carried.
set -u
out=${OUT:-/tmp/out}/a; mkdir -p "$out"
git log -1 --format=%H > "$out/commit.txt" 2>/dev/null
GPUS=2 OURS_ROWS='pcie48-hybrid/s16,pcie48-hybrid-noclip/s16' OURS_BUDGET_S=230 BENCH_ARGS='--iterations 8' \
  PEERS=roundpipe PEER_BUDGETS='roundpipe=240' PEERS_ARGS='--grad_clip 1.0 --roundpipe_points async:8,sync:8' \
  JIT_TIMEOUT_S=100 timeout 565 bash bench/peer_session.sh "$out" 540 > "$out/session.txt" 2>&1
find "$out" -name "*.lock" -delete; find "$out" -name "*.pt" -delete
tail -n 8 "$out/session.txt"
cd "$out/.." && tar czf call2.tgz a && rm -rf a
