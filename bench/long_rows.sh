#!/usr/bin/env bash
# One device call, one GPU: bench/long_rows.py's rows back to back within TOTAL_S, wheels first.
#   OUT=$OUT bash bench/long_rows.sh                  (from the project root, .whl carried)
# Environment (defaults in brackets): TOTAL_S [585: the whole call, this script included],
# ROWS [bench/long_rows.py's DEFAULT_ROWS], CAP_GB [24], MODEL [llama-3b].
# .whl must hold what /work/shared/gpu/wheels.sh (datasets) and peer_wheels.sh (roundpipe, ninja
# and their needs) fetch. RoundPipe's CPU Adam compiles on first use: it is built in the
# background while this project's first rows run (bench/families.sh does the same).
set -u
out=${OUT:-/tmp/out}; t0=$(date +%s); total=${TOTAL_S:-585}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. bench/wheels_env.sh "$out/install.log"
{ nvidia-smi; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; git rev-parse HEAD 2>/dev/null; } > "$out/versions.txt" 2>&1
case "${ROWS:-roundpipe}" in *roundpipe*)
  ( timeout 240 python3 bench/roundpipe_adam.py >"$out/jit_roundpipe.log" 2>&1 ) & ;;
esac
left=$(( total - ($(date +%s) - t0) - 15 ))  # 15 s for the table and the transfer back
rows=()
[ -n "${ROWS:-}" ] && rows=(--rows "$ROWS")
timeout $(( left + 10 )) python3 bench/long_rows.py --out "$out" --budget_s "$left" --cap_gb "${CAP_GB:-24}" \
  --model "${MODEL:-llama-3b}" "${rows[@]}" 2>&1 | tee -a "$out/session.txt"
tail -n 1 "$out/jit_roundpipe.log" 2>/dev/null
echo "done at $(( $(date +%s) - t0 ))s" >> "$out/session.txt"
