#!/usr/bin/env bash
# Call 2: the flex failure alone, and each failing group of call 1 in its own process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
export PYTHONPATH=/tmp/site:$PWD
D=bench/results/2026-11-27_one_gpu_tests_and_structure_check
timeout -k 5 150 python3 $D/probe_flex.py > $OUT/probe.txt 2>&1; echo "probe rc $?" >> $OUT/probe.txt
grep -v "^  " $OUT/probe.txt | tail -30
n=0
for sel in "tests/gpu/test_gpu.py -k compiled_layers_match_eager" "tests/gpu/test_gpu.py -k fused_last" \
           "tests/gpu/test_gpu_long.py -k 'segment_attention_holds_no_scores or gpu_kernels_train'" \
           "tests/one_process/test_families.py -m gpu"; do
  n=$((n + 1))
  eval timeout -k 5 ${T:-100} python3 -m pytest -q -rA $sel > $OUT/group$n.txt 2>&1; echo "rc $?" >> $OUT/group$n.txt
  echo "== $sel"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^rc" $OUT/group$n.txt | tail -25
done
