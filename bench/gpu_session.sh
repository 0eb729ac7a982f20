#!/usr/bin/env bash
# Everything measured on the GPU machine in one call: environment, GPU tests, benchmark rows.
#   bash bench/gpu_session.sh OUT_DIR [BENCH_BUDGET_S] [ROWS] [SINGLE_GPU_BUDGET_S]
# SINGLE_GPU_BUDGET_S > 0 also runs bench/single_gpu_baseline.py (llama-2-7b, 24 GiB cap, GPU 0) after the rows.
# BENCH_ARGS: extra flags for bench/offload_bench.py (e.g. "--iterations 5").
# GPU_TESTS: pytest -k expression for tests/gpu/test_gpu.py ("" skips them; default: every GPU test);
# GPU_TESTS_TIMEOUT_S (default 300) bounds them. The full pytest output goes to OUT_DIR/gpu_tests.txt.
set -u
out=${1:-bench_results}; budget=${2:-380}; rows=${3:-}; single=${4:-0}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m | tee "$out/topo.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
env | grep -E '^NCCL_|^TORCH_' | sort
if [ -n "${GPU_TESTS-all}" ]; then
  k=${GPU_TESTS:-}; [ "$k" = all ] && k=""
  timeout "${GPU_TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -m gpu tests/gpu/test_gpu.py ${k:+-k "$k"} >"$out/gpu_tests.txt" 2>&1
  tail -4 "$out/gpu_tests.txt"
fi
if [ "$budget" -gt 0 ]; then
  python3 bench/offload_bench.py --out "$out/bench" --budget_s "$budget" ${rows:+--rows "$rows"} ${BENCH_ARGS:-}
fi
if [ "$single" -gt 0 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 bench/single_gpu_baseline.py --model llama-2-7b --mem_cap_gb 24 \
    --budget_s "$single" --json "$out/single_gpu.json" 2>"$out/single_gpu.err"
fi
