#!/usr/bin/env bash
# The one-GPU table in one device call of at most 9.5 minutes, on nvidia-h200 (one H200, 16 cores,
# 125 GiB host): llama-3b (OpenLLaMA-3B shapes, random weights), batch 64 x 512 synthetic tokens,
# bf16 with fp32 AdamW state, activation checkpointing, a 48 GiB cap, clipping 1.0 for every
# system (FSDP2 and RoundPipe: the host gradients' norm on every core, bench/host_clip.py;
# DeepSpeed: its own, on the GPU). In order, each part within its share of the call:
#   this project's hybrid row (1f1b, 4 micro-batches, resident stages and kept layers as the plan
#   picks them) clipped and unclipped, each with its timeline (+sequential: timeline.json and .png
#   in a/bench/<row>/), then the activation-offload row;
#   RoundPipe's asynchronous step (8 micro-batches), DeepSpeed ZeRO-Offload (micro-batch 32) and
#   FSDP2 + CPUOffloadPolicy (micro-batch 32, deferred gradient sync): each peer at the point that
#   won its sweeps (bench/results/2026-11-27_3b_one_gpu_peers, 2026-11-28_two_gpus_parity).
# Run from the project root with .whl carried (bench/README.md, "Command"):
#   OUT=$OUT bash bench/one_gpu_table.sh
# The table: a/peers.md (every system; a/bench/table.md: this project's rows in detail); the host:
# a/versions.txt ("cores N"), a/lscpu.txt. Everything comes back as all.tgz. A peer cut by the
# call's limit leaves its sweep in a/peers/; `python3 bench/peers.py --summarise a` makes the table.
set -u
out=${OUT:-/tmp/out}/a; mkdir -p "$out"; t0=$(date +%s)
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null
git status --short --untracked-files=no >> "$out/commit.txt" 2>/dev/null
lscpu > "$out/lscpu.txt" 2>&1
R='@llama-3b~num_chunks=4'
ROWS="pcie48-hybrid/s13+sequential$R,pcie48-hybrid-noclip/s13+sequential$R,pcie48-actoff/s13@llama-3b"
GPUS=1 OURS_ROWS="$ROWS" OURS_BUDGET_S=235 BENCH_ARGS='--schedule 1f1b' \
  PEERS=roundpipe,deepspeed,fsdp2 PEER_BUDGETS='roundpipe=65,deepspeed=80,fsdp2=90' \
  PEERS_ARGS='--model llama-3b --grad_clip 1.0 --roundpipe_points async:8 --deepspeed_micro_batches 32 --fsdp_micro_batches 32 --fsdp_sync_modes deferred' \
  JIT_TIMEOUT_S=100 timeout 548 bash bench/peer_session.sh "$out" 540 > "$out/session.txt" 2>&1
echo "done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
find "$out" -name "*.lock" -delete; find "$out" -name "*.pt" -delete
grep -E "^(gpus|torch|roundpipe|deepspeed) " "$out/versions.txt" 2>/dev/null
cat "$out/peers.md" 2>/dev/null; cat "$out/bench/table.md" 2>/dev/null; tail -n 2 "$out/session.txt"
cd "$out/.." && tar czf all.tgz a && rm -rf a
