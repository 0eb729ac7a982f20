#!/usr/bin/env bash
# QLoRA rows (load_in_4bit) in ONE device call on nvidia-h200 (one GPU, a 24 GiB cap), about 8 minutes:
#   OUT=$OUT bash bench/qlora_rows.sh                  (run it with timeout_s 540)
# The GPU machine has no bitsandbytes and no network: first, here, bash ../shared/gpu/wheels.sh and
# bash bench/bnb_wheel.sh fill .whl/ (carry it; bench/wheels_env.sh installs it there).
# Random-weight presets, bf16, LoRA rank 16, alpha 32 on every linear layer, NUM_ITERATIONS [3] steps
# each (the table leaves out the first), in this order:
#   70b      llama-3-70b, QLoRA nf4, BATCH_70B [4] rows of 4096 tokens (one a micro-batch), the stages the
#            plan picks, use_offload, activation_offload, host_memory_gb 64: the run is refused before it
#            loads if the plan needs more host memory than that
#   8b       llama-3-8b, QLoRA nf4, the LoRA short row: 64 x 512 tokens in 8 micro-batches
#   8b-bf16  the same row on the bf16 base (bench/lora_rows.sh's ROW=8b row)
#   peer     peft + bitsandbytes QLoRA on plain Hugging Face, the same row (bench/peer_qlora.py),
#            micro-batches PEER_MICRO [8,16]
#   8b-long  (only with ROWS including it) llama-3-8b QLoRA, one row of LONG_LEN [32768] tokens, the
#            plan's stages, segments and tiling
# ROWS [70b,8b,8b-bf16,peer] picks them. Every row's plan (--plan of the same flags: the peaks to set
# beside the measured ones) is written first, all plans at once on the CPU. Each row runs within its
# limit (ROW_S_70B [230], ROW_S_8B [80] the 4-bit 8B row, ROW_S_BF16 [130] the bf16 one, whose start-up
# draws and converts 16 GB of weights: 42 s on 2026-12-02, ROW_S_PEER [100], ROW_S_LONG [150]) and what is
# left of TOTAL_S [480]; torchrun gets 30 s more to stop its workers. The 70b row runs as one process
# under bench/memory_at_peak.py (PEAK_70B [1]; 0: torchrun), whose peak.txt says what the GPU held at
# its peak. Writes $OUT/qlora/<row>/ (plan.txt, train.log, results.json, peak.txt),
# $OUT/qlora/peers/peft-qlora.json, the table $OUT/qlora/table.md (bench/qlora_table.py), and all of
# it as $OUT/qlora.tgz (a device call brings back only a few files).
set -u
out=${OUT:-/tmp/out}/qlora; iters=${NUM_ITERATIONS:-3}; t0=$(date +%s); total=${TOTAL_S:-480}
rows=",${ROWS:-70b,8b,8b-bf16,peer},"
left() { echo $(( total - ($(date +%s) - t0) )); }
limit() { local l; l=$(( $(left) - 10 )); [ "$1" -lt "$l" ] && l=$1; echo "$l"; }
mkdir -p "$out/peers"
export PYTHONUNBUFFERED=1
[ -f bench/wheels_env.sh ] && . bench/wheels_env.sh "$out/install.log"
{ nvidia-smi; python3 -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)"
  git rev-parse HEAD 2>/dev/null; } > "$out/versions.txt" 2>&1
lora=(--lora_rank 16 --lora_alpha 32 --lora_target_modules all-linear)
q4=(--load_in_4bit --bnb_4bit_quant_type nf4)
common=(--config "" --dataset synthetic --device cuda --gpu_memory_gb 24 --use_offload --activation_checkpointing
        --num_iterations "$iters" --overwrite --no_save_model --no_progress_bar "${lora[@]}")
short=(--model llama-3-8b --batch_size 64 --num_chunks 8 --seq_length 512 --num_stages -1)
job() {  # the flags of row $1
  case "$1" in
    70b)     echo --model llama-3-70b --batch_size "${BATCH_70B:-4}" --num_chunks "${BATCH_70B:-4}" --seq_length 4096 \
               --num_stages -1 --activation_offload --host_memory_gb 64 "${q4[@]}" ;;
    8b)      echo "${short[@]}" "${q4[@]}" ;;
    8b-bf16) echo "${short[@]}" ;;
    8b-long) echo --model llama-3-8b --batch_size 1 --num_chunks 1 --seq_length "${LONG_LEN:-32768}" --num_stages -1 \
               --seq_chunks -1 --activation_offload --allow_long_sequences "${q4[@]}" ;;
  esac
}
ours=(); for r in 70b 8b 8b-bf16 8b-long; do [[ $rows == *",$r,"* ]] && ours+=("$r"); done
for r in "${ours[@]}"; do  # the plans, together, on the CPU
  mkdir -p "$out/$r"
  # shellcheck disable=SC2046
  python3 main.py --plan --nproc 1 "${common[@]}" --save_dir "$out/$r/run" $(job "$r") > "$out/$r/plan.txt" 2>&1 &
done
wait
echo "plans done at $(( $(date +%s) - t0 ))s"
for r in "${ours[@]}"; do
  case "$r" in 70b) cap=${ROW_S_70B:-230} ;; 8b-long) cap=${ROW_S_LONG:-150} ;; 8b-bf16) cap=${ROW_S_BF16:-130} ;;
    *) cap=${ROW_S_8B:-80} ;; esac
  s=$(limit "$cap")
  if [ "$s" -lt 30 ]; then echo "$r: not run (budget)" | tee "$out/$r/train.log"; continue; fi
  echo "== $r within ${s}s"; grep -E "^ +0 |^GPU|^host" "$out/$r/plan.txt"
  launch=(python3 -m torch.distributed.run --standalone --nproc_per_node 1 main.py)
  if [ "$r" = 70b ] && [ "${PEAK_70B:-1}" = 1 ]; then launch=(python3 bench/memory_at_peak.py --out "$out/$r/peak.txt" --); fi
  # torchrun stops its workers on SIGTERM (they run in sessions of their own): -k leaves it the time
  # shellcheck disable=SC2046
  timeout -k 30 "$s" "${launch[@]}" "${common[@]}" --save_dir "$out/$r/run" --save_results "$out/$r/results.json" \
    $(job "$r") > "$out/$r/train.log" 2>&1
  echo "$r: rc $? at $(( $(date +%s) - t0 ))s"; grep -E "^(step|summary|error)" "$out/$r/train.log" | tail -4
done
if [[ $rows == *",peer,"* ]]; then
  s=$(limit "${ROW_S_PEER:-100}")
  if [ "$s" -ge 40 ]; then
    echo "== peer within ${s}s"
    timeout -k 10 "$s" python3 bench/peer_qlora.py --model llama-3-8b --batch_size 64 --seq_length 512 \
      --mem_cap_gb 24 "${lora[@]}" --micro_batches "${PEER_MICRO:-8,16}" --iterations $(( iters - 1 )) --warmup 1 \
      --budget_s $(( s - 10 )) --json "$out/peers/peft-qlora.json" > "$out/peers/peft-qlora.log" 2>&1
    echo "peer: rc $?"; grep "^peft-qlora" "$out/peers/peft-qlora.log"
  fi
fi
python3 bench/qlora_table.py "$out" --warmup 1
echo "done at $(( $(date +%s) - t0 ))s"
tar czf "$out.tgz" --exclude=run -C "$(dirname "$out")" "$(basename "$out")"
