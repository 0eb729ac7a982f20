#!/usr/bin/env bash
# Device call 1: reproduce the 1F1B hang, then try candidate causes. Everything bounded.
set -u
export OUT=${OUT:-/tmp/out}
source bench/results/2026-11-23_1f1b_hang_two_gpus/scripts/deadlock.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
env | grep -E '^(NCCL|TORCH|CUDA)_' | sort
L=8
run base8 8 1f1b --
if [ $? -eq 0 ]; then
  L=32; export DUMP_S=100 RUN_TIMEOUT=170
  run base32 32 1f1b --
fi
run eager$L $L 1f1b CUDA_MODULE_LOADING=EAGER --
run conn$L $L 1f1b CUDA_DEVICE_MAX_CONNECTIONS=32 --
run inter$L $L interleaved CUDA_MODULE_LOADING=EAGER --
