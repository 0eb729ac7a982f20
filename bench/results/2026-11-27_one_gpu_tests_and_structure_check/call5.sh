#!/usr/bin/env bash
# Call 5: the segment kernels' test on longer rows; the hybrid row after and before the
# restructuring (after first: it compiles the kernels both trees share), then num_chunks 8 and 4.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
export PYTHONPATH=/tmp/site
timeout -k 5 120 python3 -m pytest -q -rA tests/gpu/test_gpu_long.py -k gpu_kernels_train > $OUT/kernels.txt 2>&1
grep -E "^(PASSED|FAILED)|passed|failed" $OUT/kernels.txt
B="--gpus 1 --model llama-3b --schedule 1f1b --num_stages 13 --iterations 5 --warmup 2 --row_timeout_s 115 --budget_s 120"
R=pcie48-hybrid/s13@llama-3b
timeout -k 5 125 python3 bench/offload_bench.py $B --rows $R --out $OUT/after > $OUT/after.log 2>&1
(cd .before && timeout -k 5 125 python3 bench/offload_bench.py $B --rows $R --out $OUT/before > $OUT/before.log 2>&1)
timeout -k 5 240 python3 bench/offload_bench.py ${B/--budget_s 120/--budget_s 235} --rows "$R~num_chunks=8,$R~num_chunks=4" \
  --out $OUT/chunks > $OUT/chunks.log 2>&1
for d in after before chunks; do echo "== $d"; cat $OUT/$d/table.md 2>/dev/null || tail -5 $OUT/$d.log; done
cd $OUT && tar czf rows.tgz after before chunks *.log && rm -rf after before chunks *.log
