#!/usr/bin/env bash
# The one-GPU peer table of issue 30 (llama-3b, batch 64 x 512, 48 GiB cap), every system in one call.
GPUS=1 KEEP0=0 OURS_ROWS='pcie48-hybrid/s13@llama-3b~num_chunks=4,pcie48-actoff/s13@llama-3b~partition=layers' \
  OURS_BUDGET_S=200 PEERS=fsdp2,roundpipe,deepspeed PEER_BUDGETS=fsdp2=100,roundpipe=140,deepspeed=110 \
  PEERS_ARGS='--model llama-3b --fsdp_micro_batches 32,16 --roundpipe_points async:8,async:4,sync:8 --deepspeed_micro_batches 32' \
  JIT_TIMEOUT_S=110 TOTAL_S=575 OUT=$OUT bash bench/keep_and_peers.sh
cat $OUT/session.txt | grep -v "^\s*$" | tail -40
find $OUT/a -name "table.md" -o -name "*.md" | head; for f in $(find $OUT/a -name "*.md"); do echo "== $f"; cat "$f"; done
cd $OUT && tar czf all.tgz a session.txt && rm -rf a session.txt
