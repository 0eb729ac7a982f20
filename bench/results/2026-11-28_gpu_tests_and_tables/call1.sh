#!/bin/bash
# Every GPU test (the pool buffers' event, the first step of long rows, the cuDNN path, the plan
# against measured peaks), output straight under $OUT so that a cut call still returns it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cudnn', torch.backends.cudnn.version())"
  git rev-parse HEAD; } > $OUT/versions.txt 2>&1
timeout 520 python3 -m pytest -q -rA -s -m gpu tests --durations=15 > $OUT/pytest.txt 2>&1
echo "pytest rc=$?" >> $OUT/versions.txt
