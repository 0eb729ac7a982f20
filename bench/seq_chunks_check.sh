#!/usr/bin/env bash
# seq_chunks on one GPU: the same runs with K = 1 and K > 1 (losses), and the measured peak
# memory beside the --plan estimate of each.
#   bash bench/seq_chunks_check.sh OUT_DIR
# (1) float32, 4 Llama-2-7B layers (random weights), seq 4096: K = 1, 4 -- the losses agree to float32.
# (2) bfloat16 with offload, seq 16384: K = 1, 4 -- peak memory against the plan.
set -u
out=${1:-seq_chunks_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
common=(--config "" --model llama-2-7b --num_layers 4 --num_stages 2 --dataset synthetic --allow_long_sequences
        --batch_size 2 --num_chunks 2 --num_iterations 3 --device cuda --no_save_model --no_save_metrics
        --no_progress_bar --overwrite)
run() {  # name, flags...
  local name=$1; shift
  python3 main.py "${common[@]}" "$@" --nproc 1 --plan >"$out/$name.plan.txt" 2>&1
  timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py "${common[@]}" "$@" \
    --save_dir "$out/$name" >"$out/$name.log" 2>&1
  echo "$name rc=$? $(grep -E '^summary' "$out/$name.log") | plan: $(grep -E '^ +0 ' "$out/$name.plan.txt")"
}
for k in 1 4; do
  run fp32_k$k --dtype float32 --seq_length 4096 --seq_chunks $k
done
for k in 1 4; do
  run bf16_offload_k$k --dtype bfloat16 --seq_length 16384 --use_offload --resident_stages 0 --seq_chunks $k
done
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("fp32_k1", "fp32_k4", "bf16_offload_k1", "bf16_offload_k4"):
    path = out / name / "results.json"
    if path.exists():
        rows = json.loads(path.read_text())["iterations"]
        print(name, "losses", [r["loss"] for r in rows], "peak GiB", max(max(r["peak_mem_bytes"]) for r in rows) / 2**30,
              "step s", rows[-1]["step_time_s"])
EOF
