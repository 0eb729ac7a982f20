#!/usr/bin/env bash
# Everything measured on the GPU machine in one call: environment, GPU tests, benchmark rows.
#   bash bench/gpu_session.sh OUT_DIR [BENCH_BUDGET_S] [ROWS]
set -u
out=${1:-bench_results}; budget=${2:-380}; rows=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m | tee "$out/topo.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
env | grep -E '^NCCL_|^TORCH_' | sort
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -x -k "2" 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
python3 bench/offload_bench.py --out "$out/bench" --budget_s "$budget" ${rows:+--rows "$rows"}
