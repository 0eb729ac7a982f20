#!/usr/bin/env bash
# Issue 30, one GPU: the peer table (llama-3b, batch 64 x 512, 48 GiB cap, clip 1.0), every system in one
# call, this project with its defaults after call 1 (the even split on one GPU, resident stages up to the
# plan's 90%); each peer at the point that won its sweep on 2026-11-27 (FSDP2 micro-batch 32 of 32, 16;
# RoundPipe 8 micro-batches of 8, 4), RoundPipe in both step modes. Then whether the GPU would add
# optimizer bandwidth to the host's (bench/host_and_device_adamw.py), if time is left.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s)
GPUS=1 KEEP0=0 OURS_ROWS='pcie48-hybrid/s13@llama-3b~num_chunks=4,pcie48-actoff/s13@llama-3b' \
  OURS_BUDGET_S=190 PEERS=fsdp2,roundpipe,deepspeed PEER_BUDGETS=fsdp2=80,roundpipe=120,deepspeed=100 \
  PEERS_ARGS='--model llama-3b --fsdp_micro_batches 32 --roundpipe_points async:8,sync:8 --deepspeed_micro_batches 32' \
  JIT_TIMEOUT_S=110 TOTAL_S=520 OUT=$out bash bench/keep_and_peers.sh
left=$(( 590 - ($(date +%s) - t0) ))
[ "$left" -gt 40 ] && PYTHONPATH=$PWD/.whl-site:${PYTHONPATH:-} timeout $(( left - 5 )) \
  python3 bench/host_and_device_adamw.py --numel 250e6 --threads 14 > "$out/a/host_and_device.txt" 2>&1
find "$out/a" -name "*.lock" -delete
grep -v "^\s*$" "$out/session.txt" | tail -25; cat "$out/a/host_and_device.txt"
cd "$out" && tar czf all.tgz a session.txt && rm -rf a session.txt
