#!/bin/bash
# sdpa's cuDNN kernel for whole causal rows: the GPU tests, then the 64K row and the hybrid short
# row with --attention_backend auto (cuDNN) and flash, back to back.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl > $OUT/install.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpus.txt
timeout 260 python3 -m pytest -q -rA -s -m gpu tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_long.py \
  "tests/gpu/test_gpu.py::test_compiled_layers_match_eager" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?" >> $OUT/rcs.txt
N=$(nproc)
run() {  # name, timeout, flags...
  local name=$1 t=$2; shift 2
  OMP_NUM_THREADS=$N timeout $t python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py \
    --config "" --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --activation_checkpointing \
    --use_offload --no_save_model --no_progress_bar --overwrite --save_dir /tmp/$name \
    --save_results $OUT/$name.results.json "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?" >> $OUT/rcs.txt
}
H="--seq_length 512 --batch_size 64 --num_chunks 4 --num_stages 13 --schedule 1f1b --gpu_memory_gb 48 --use_prefetch
   --keep_layers -1 --grad_clip 1.0 --resident_stages -1 --num_iterations 7"
L="--allow_long_sequences --seq_length 65536 --batch_size 1 --num_chunks 1 --num_stages -1 --seq_chunks -1 --tiled_mlp auto
   --resident_stages 0 --activation_offload --gpu_memory_gb 24 --num_iterations 3"
run long64k_cudnn 150 $L
run long64k_flash 150 $L --attention_backend flash
run hybrid_cudnn 100 $H
run hybrid_flash 100 $H --attention_backend flash
cd $OUT && tar czf all.tgz *.json *.log *.txt && rm -f *.results.json
