#!/usr/bin/env bash
# LoRA rows (one device call each; random-weight presets, bf16, rank 16 on every linear layer):
#   ROW=8b    OUT=$OUT bash bench/lora_rows.sh   one GPU at 24 GiB, llama-3-8b, batch 64 x 512
#   ROW=70b   OUT=$OUT bash bench/lora_rows.sh   two GPUs at 24 GiB each, llama-3-70b, 4K-token rows
#   ROW=long  OUT=$OUT bash bench/lora_rows.sh   one GPU at 24 GiB, llama-3-8b, the longest row the plan
#                                                admits (LEN, default: the plan's own figure)
# Each row writes the plan first (--plan, to compare with the measured peak: the target is 10%)
# and then trains NUM_ITERATIONS [5] steps, results.json and metrics.jsonl under $OUT/<row>.
# The peers on the same job (RoundPipe's LoRA path, peft + FSDP2 with CPU offload) are owed: their
# scripts (bench/roundpipe_baseline.py, bench/fsdp2_baseline.py) have no LoRA switch yet.
set -u
out=${OUT:-/tmp/out}; row=${ROW:-8b}; iters=${NUM_ITERATIONS:-5}
mkdir -p "$out/$row"
export PYTHONUNBUFFERED=1
[ -f bench/wheels_env.sh ] && . bench/wheels_env.sh "$out/install.log"
{ nvidia-smi; python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'peft', peft.__version__)"; git rev-parse HEAD 2>/dev/null; } > "$out/versions.txt" 2>&1
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
python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc" main.py "${common[@]}" "${job[@]}" \
  "${lora[@]}" --save_results "$out/$row/results.json" 2>&1 | tee "$out/$row/train.log"
