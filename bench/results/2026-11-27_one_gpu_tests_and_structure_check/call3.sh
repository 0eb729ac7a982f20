#!/usr/bin/env bash
# Call 3: which shapes compiled flex lowers here, one process a case.
export PYTHONPATH=$PWD
D=bench/results/2026-11-27_one_gpu_tests_and_structure_check
for c in "float32 16 96 96 0" "float32 16 96 96 1" "bfloat16 64 96 96 0" "bfloat16 64 128 128 0" "bfloat16 64 256 256 0" \
         "float32 16 128 128 0" "float32 16 200 200 0" "bfloat16 64 64 192 0" "bfloat16 64 1024 4096 0"; do
  timeout -k 5 60 python3 $D/probe_flex.py $c > $OUT/probe_${c// /_}.txt 2>&1
  grep RESULT $OUT/probe_${c// /_}.txt || tail -3 $OUT/probe_${c// /_}.txt
done
cd $OUT && tar czf probes.tgz probe_*.txt && rm probe_*.txt
