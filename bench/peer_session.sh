#!/usr/bin/env bash
# This project's rows and every peer on one job, in one GPU-machine call, with one table at the end.
#   bash bench/peer_session.sh OUT_DIR [BUDGET_S]
# Run from the project root with .whl/ carried (bash ../shared/gpu/wheels.sh and peer_wheels.sh
# fill it; wheels.sh's extra arguments add DeepSpeed's and RoundPipe's small needs, see
# bench/README.md). BUDGET_S (default 530) bounds everything after the install; the parts run in
# order, each within its share and never past what is left:
#   OURS_ROWS (default "pcie48-hybrid/s16,pcie48-prefetch,pcie48-delayed") within OURS_BUDGET_S
#   (default 160),
#   then PEERS (default "fsdp2,deepspeed,roundpipe") within what is left, each within its
#   PEER_BUDGETS share (bench/peers.py --peer_budgets, e.g. "fsdp2=150,deepspeed=170,roundpipe=330").
# GPUS (default 2) is the GPU count of every row and peer.
# The CPU optimizers of DeepSpeed and RoundPipe JIT-compile (g++/ninja) in the background during
# the install, before any GPU row runs (JIT_TIMEOUT_S, default 150).
set -u
out=${1:-peer_results}; budget=${2:-530}; gpus=${GPUS:-2}
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. bench/wheels_env.sh "$out/install.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/gpus.txt"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
python3 - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib, os
for m in ("torch", "transformers", "deepspeed", "roundpipe", "ninja", "cpuinfo"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "NOT IMPORTABLE:", type(e).__name__, str(e)[:200])
import torch
print("gpus", torch.cuda.device_count(), "cores", len(os.sched_getaffinity(0)))
PY
jit=${JIT_TIMEOUT_S:-150}
( timeout "$jit" python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('deepspeed cpu_adam ready')" \
    >"$out/jit_deepspeed.log" 2>&1; echo "rc $?" >>"$out/jit_deepspeed.log" ) &
j1=$!
( timeout "$jit" python3 bench/roundpipe_adam.py >"$out/jit_roundpipe.log" 2>&1
  echo "rc $?" >>"$out/jit_roundpipe.log" ) &
j2=$!
wait $j1 $j2
tail -n 2 "$out/jit_deepspeed.log" "$out/jit_roundpipe.log"
echo "prelude done at $(( $(date +%s) - t0 ))s"

rows=${OURS_ROWS-pcie48-hybrid/s16,pcie48-prefetch,pcie48-delayed}
ours=${OURS_BUDGET_S:-160}; [ "$ours" -gt "$(left)" ] && ours=$(left)
if [ -n "$rows" ] && [ "$ours" -ge 60 ]; then
  python3 bench/offload_bench.py --gpus "$gpus" --rows "$rows" --iterations 5 --warmup 2 --budget_s "$ours" \
    --row_timeout_s 150 --out "$out/bench" ${BENCH_ARGS:-} >"$out/ours.log" 2>&1
  tail -n 4 "$out/ours.log"
fi
echo "our rows done at $(( $(date +%s) - t0 ))s"
rest=$(left)
if [ "$rest" -ge 60 ]; then
  python3 bench/peers.py --gpus "$gpus" --out "$out" --ours "$out/bench" --budget_s "$rest" --peers "${PEERS:-fsdp2,deepspeed,roundpipe}" \
    --peer_budgets "${PEER_BUDGETS:-}" ${PEERS_ARGS:-}
else
  python3 bench/peers.py --gpus "$gpus" --summarise "$out" --ours "$out/bench" --peers "${PEERS:-fsdp2,deepspeed,roundpipe}"
fi
echo "session done at $(( $(date +%s) - t0 ))s"
