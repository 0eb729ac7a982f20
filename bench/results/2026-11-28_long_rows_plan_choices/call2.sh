#!/bin/bash
# The long-row GPU tests (plan against measured peaks, the first step, the kernels against the
# reference), then the segment rows and FSDP2 at 64K; everything tarred so that it all comes back.
set -u
t0=$(date +%s)
. bench/wheels_env.sh "$OUT/install.log"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cudnn', torch.backends.cudnn.version())"
  git rev-parse HEAD; } > $OUT/versions.txt 2>&1
timeout ${PYTEST_S:-220} python3 -m pytest -q -rA -s -m gpu tests/gpu/test_gpu_long.py --durations=10 > $OUT/pytest.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 ))s" >> $OUT/versions.txt
mkdir -p $OUT/lr
ROWS=${ROWS:-ours@16384/seg4,ours@32768/seg8,ours@65536/seg8,fsdp2@65536} TOTAL_S=$(( ${TOTAL_S:-575} - ($(date +%s) - t0) )) \
  OUT=$OUT/lr bash bench/long_rows.sh > /dev/null 2>&1
cp $OUT/lr/long_rows.md $OUT/lr/session.txt $OUT/ 2>/dev/null
( cd $OUT && find lr -name .lock -delete; tar czf lr.tgz lr && rm -rf lr )
