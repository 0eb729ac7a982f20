#!/usr/bin/env bash
# Issue 30 (and 28's caveat), one GPU: the GPU tests with this session's defaults and the plan's current terms.
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); mkdir -p "$out/a"
source bench/wheels_env.sh "$out/a/install.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$out/a/gpus.txt"
timeout 470 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf > "$out/a/pytest.txt" 2>&1
echo "rc $? at $(( $(date +%s) - t0 ))s" >> "$out/a/pytest.txt"
tail -30 "$out/a/pytest.txt"
