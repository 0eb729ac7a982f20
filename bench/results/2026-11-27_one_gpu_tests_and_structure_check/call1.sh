#!/usr/bin/env bash
# Call 1: the whole GPU layer in one process, every failure's text kept.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $OUT/gpu.txt
timeout -k 5 ${PYTEST_S:-480} python3 -m pytest -q -rA -m gpu tests --durations=30 \
  --junitxml=$OUT/junit.xml > $OUT/pytest.txt 2>&1
echo "pytest rc $?" >> $OUT/pytest.txt
tail -c 6000 $OUT/pytest.txt
