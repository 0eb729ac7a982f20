#!/bin/bash
# Where the optimizer wait comes from: host AdamW speed on this machine, and one timeline of the
# hybrid short row (4 micro-batches) and of the 64K row (3 steps, the third recorded).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl > $OUT/install.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
lscpu > $OUT/lscpu.txt; free -g >> $OUT/lscpu.txt
N=$(nproc)
timeout 100 python3 bench/cpu_adamw_bench.py --numel 250e6 --procs 1 --threads 14 --reps 3 --chunks 4194304 > $OUT/adamw14.txt 2>&1
run() {  # name, timeout, flags...
  local name=$1 t=$2; shift 2
  OMP_NUM_THREADS=$N timeout $t python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py --config "" \
    --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --activation_checkpointing --use_offload \
    --no_save_model --no_progress_bar --overwrite --save_dir /tmp/$name --timeline "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?" >> $OUT/rcs.txt
  cp /tmp/$name/timeline.json $OUT/$name.timeline.json 2>/dev/null
}
run hybrid4 200 --seq_length 512 --batch_size 64 --num_chunks 4 --num_stages 13 --schedule 1f1b --gpu_memory_gb 48 \
  --use_prefetch --keep_layers -1 --grad_clip 1.0 --resident_stages -1 --num_iterations 6 --timeline_iteration -1
run long64k 280 --allow_long_sequences --seq_length 65536 --batch_size 1 --num_chunks 1 --num_stages -1 --seq_chunks -1 \
  --tiled_mlp auto --resident_stages 0 --activation_offload --gpu_memory_gb 24 --num_iterations 3 --timeline_iteration -1
cd $OUT && tar czf all.tgz *.json *.log *.txt && rm -f *.timeline.json
