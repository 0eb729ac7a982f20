#!/bin/bash
# The blocked gradient norm (this tree) against HEAD before it (.before/), the hybrid short row and
# the 64K row, in one call; and the attention kernels at head_dim 100.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl > $OUT/install.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpus.txt
timeout 150 python3 bench/attention_kernels.py --head_dim 100 --heads 32 --shapes 1x65536,1x16384,16x512 \
  --json $OUT/attention.json > $OUT/attention.txt 2>&1
N=$(nproc)
run() {  # tree, name, timeout, flags...
  local tree=$1 name=$2 t=$3; shift 3
  (cd $tree && OMP_NUM_THREADS=$N timeout $t python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py \
    --config "" --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --activation_checkpointing \
    --use_offload --no_save_model --no_progress_bar --overwrite --save_dir /tmp/$name --timeline \
    --save_results $OUT/$name.results.json "$@" > $OUT/$name.log 2>&1)
  echo "$name rc=$?" >> $OUT/rcs.txt
  cp /tmp/$name/timeline.json $OUT/$name.timeline.json 2>/dev/null
}
H="--seq_length 512 --batch_size 64 --num_chunks 4 --num_stages 13 --schedule 1f1b --gpu_memory_gb 48 --use_prefetch
   --keep_layers -1 --grad_clip 1.0 --resident_stages -1 --num_iterations 7 --timeline_iteration -1"
L="--allow_long_sequences --seq_length 65536 --batch_size 1 --num_chunks 1 --num_stages -1 --seq_chunks -1 --tiled_mlp auto
   --resident_stages 0 --activation_offload --gpu_memory_gb 24 --num_iterations 3 --timeline_iteration -1"
run . hybrid_after 150 $H
run .before hybrid_before 150 $H
run . hybrid_after2 150 $H
run . long64k_after 200 $L
cd $OUT && tar czf all.tgz *.json *.log *.txt && rm -f *.timeline.json *.results.json
