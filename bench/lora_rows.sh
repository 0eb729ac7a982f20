#!/usr/bin/env bash
# LoRA rows (one device call each; random-weight presets, bf16, rank 16 on every linear layer):
#   ROW=8b    OUT=$OUT bash bench/lora_rows.sh   one GPU at 24 GiB, llama-3-8b, batch 64 x 512, then its peers
#   ROW=70b   OUT=$OUT bash bench/lora_rows.sh   two GPUs at 24 GiB each, llama-3-70b, 4K-token rows
#   ROW=long  OUT=$OUT bash bench/lora_rows.sh   one GPU at 24 GiB, llama-3-8b, the longest row the plan
#                                                admits (LEN, default: the plan's own figure)
# Each row writes the plan first (--plan, to compare with the measured peak: the target is 10%)
# and then trains NUM_ITERATIONS [5] steps, results.json and metrics.jsonl under $OUT/<row>.
# ROW=8b then runs the peers on the same job (bench/peers.py --lora_rank 16 ...): RoundPipe's LoRA
# path, then peft + FSDP2 with CPU offload (DeepSpeed has no LoRA row), and writes one table with
# our row first, $OUT/8b/peers.md. Its budget: one device call of at most 9.5 minutes (run it with
# timeout_s 580), TOTAL_S [555] seconds from the start for everything: install and plan (about a
# minute, RoundPipe's CPU Adam compiling meanwhile), our row within ROW_S [180] (then 40 s to
# stop), then the peers within what is left less 20 s for the table, each within its share of
# PEER_BUDGETS [roundpipe=160,fsdp2=150], RoundPipe first. Sweeps: RP_POINTS
# [async:8,sync:8,async:16,sync:16]; FSDP_MICRO [16,8,32] per GPU, gradient sync deferred to the
# last micro-batch only (one GPU: nothing to shard, and deferring keeps the adapters' 0.17 GB of
# gradients on the GPU instead of copying them to the host after every micro-batch); 32 last, as
# its float32 logits over the 128K vocabulary may not fit 24 GiB.
set -u
out=${OUT:-/tmp/out}; row=${ROW:-8b}; iters=${NUM_ITERATIONS:-5}; t0=$(date +%s)
total=${TOTAL_S:-555}
left() { echo $(( total - ($(date +%s) - t0) )); }
mkdir -p "$out/$row"
export PYTHONUNBUFFERED=1
[ -f bench/wheels_env.sh ] && . bench/wheels_env.sh "$out/install.log"
{ nvidia-smi; python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'peft', peft.__version__)"; git rev-parse HEAD 2>/dev/null; } > "$out/versions.txt" 2>&1
if [ "$row" = 8b ]; then
  # RoundPipe's CPU Adam (a JIT build) must be ready before its row; it builds while the plan runs
  ( timeout 150 python3 bench/roundpipe_adam.py >"$out/jit_roundpipe.log" 2>&1
    echo "rc $?" >>"$out/jit_roundpipe.log" ) &
  jit=$!
fi
lora=(--lora_rank 16 --lora_alpha 32 --lora_target_modules all-linear)
common=(--config "" --dataset synthetic --device cuda --gpu_memory_gb 24 --use_offload --activation_checkpointing
        --num_iterations "$iters" --save_dir "$out/$row/run" --overwrite --no_save_model --no_progress_bar)
case "$row" in
  8b)   nproc=1; job=(--model llama-3-8b --batch_size 64 --num_chunks 8 --seq_length 512 --num_stages -1) ;;
  70b)  nproc=2; job=(--model llama-3-70b --batch_size 8 --num_chunks 8 --seq_length 4096 --num_stages -1
                      --activation_offload) ;;
  long) nproc=1; job=(--model llama-3-8b --batch_size 1 --num_chunks 1 --seq_length "${LEN:-32768}"
                      --num_stages -1 --seq_chunks -1 --activation_offload --allow_long_sequences) ;;
  *) echo "ROW must be 8b, 70b or long, got $row" >&2; exit 2 ;;
esac
python3 main.py --plan --nproc "$nproc" "${common[@]}" "${job[@]}" "${lora[@]}" > "$out/$row/plan.txt" 2>&1
cat "$out/$row/plan.txt"
# the compile shares no cores with a measured step
[ "$row" = 8b ] && { wait "$jit"; tail -n 2 "$out/jit_roundpipe.log"; echo "prelude done at $(( $(date +%s) - t0 ))s"; }
# torchrun stops its workers on SIGTERM (they run in sessions of their own): -k leaves it the time
limit=(env)
[ "$row" = 8b ] && limit=(timeout -k 40 "${ROW_S:-180}")
"${limit[@]}" python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc" main.py "${common[@]}" \
  "${job[@]}" "${lora[@]}" --save_results "$out/$row/results.json" 2>&1 | tee "$out/$row/train.log"
[ "$row" = 8b ] || exit 0
echo "our row done at $(( $(date +%s) - t0 ))s"
peers=(--gpus 1 --cap_gb 24 --model llama-3-8b --batch_size 64 --seq_length 512 "${lora[@]}" --out "$out/8b"
       --ours_results "lora-8b=$out/8b/results.json" --peers roundpipe,fsdp2)
rest=$(( $(left) - 20 ))
if [ "$rest" -ge 60 ]; then
  # peers.py lets a peer run 90 s past its share before killing it; this keeps the whole within TOTAL_S
  timeout -k 10 $(( rest + 10 )) python3 bench/peers.py "${peers[@]}" --budget_s "$rest" \
    --peer_budgets "${PEER_BUDGETS:-roundpipe=160,fsdp2=150}" \
    --roundpipe_points "${RP_POINTS:-async:8,sync:8,async:16,sync:16}" \
    --fsdp_micro_batches "${FSDP_MICRO:-16,8,32}" --fsdp_sync_modes deferred 2>&1 | tee "$out/8b/peers.log"
fi
# the table again from whatever the peers wrote, should peers.py have been stopped before writing it
[ -s "$out/8b/peers.md" ] || python3 bench/peers.py "${peers[@]}" --summarise "$out/8b" > "$out/8b/peers.md"
cat "$out/8b/peers.md"
echo "done at $(( $(date +%s) - t0 ))s"
