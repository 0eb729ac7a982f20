#!/bin/bash
# The GPU tests of the cuDNN path and the long rows; then whether a whole 16K row's first-step
# gradient norm depends on the attention kernel or on compiled layers (2 steps each).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
R=$OUT/report.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $R
timeout 230 python3 -m pytest -q -rA -s -m gpu tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_long.py \
  "tests/gpu/test_gpu.py::test_compiled_layers_match_eager" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?" >> $R
N=$(nproc)
for v in "flash:true" "flash:false" "auto:true"; do
  b=${v%%:*}; c=${v##*:}
  OMP_NUM_THREADS=$N timeout 70 python3 -m torch.distributed.run --standalone --nproc_per_node=1 main.py \
    --config "" --model llama-3b --dataset synthetic --device cuda --dtype bfloat16 --activation_checkpointing \
    --use_offload --no_save_model --no_progress_bar --overwrite --save_dir /tmp/d16 --allow_long_sequences \
    --seq_length 16384 --batch_size 1 --num_chunks 1 --num_stages -1 --seq_chunks -1 --tiled_mlp auto \
    --resident_stages 0 --activation_offload --gpu_memory_gb 24 --num_iterations 2 \
    --attention_backend $b --compile_layers $c > /tmp/d16.log 2>&1
  echo "16K backend=$b compile=$c rc=$?" >> $R; grep -h "^step\|long rows" /tmp/d16.log >> $R
done
