#!/usr/bin/env bash
# Launch MMoC-Pipe with the settings of fine_tune.yaml (or $CONFIG).
#   bash train.sh                       # the run fine_tune.yaml describes
#   bash train.sh --num_iterations 5    # extra arguments go to main.py and override the YAML
# Environment overrides: CONFIG, CUDA_VISIBLE_DEVICES, NPROC, MASTER_PORT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
set -euo pipefail
cd "$(dirname "$0")"
CONFIG=${CONFIG:-fine_tune.yaml}
PY=${PYTHON:-python3}

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then exec "$PY" main.py --config "$CONFIG" --help; fi
done

# The launch settings; a YAML error is main.py's one line (file, line, column), exit 2.
launch=$("$PY" - "$CONFIG" <<'PYEOF'
import sys
from pipeline.config import ConfigError, load_yaml
try:
    c = load_yaml(sys.argv[1])
except ConfigError as e:
    sys.exit(f"error: {e}")
print(c.get("cuda_visible_devices") or "-", c.get("nproc") or 0, c.get("master_port") or 29500)
PYEOF
) || exit 2
read -r yaml_gpus yaml_nproc yaml_port <<< "$launch"
if [ -z "${CUDA_VISIBLE_DEVICES+x}" ] && [ "$yaml_gpus" != "-" ]; then
  export CUDA_VISIBLE_DEVICES="$yaml_gpus"
fi
NPROC=${NPROC:-$yaml_nproc}
MASTER_PORT=${MASTER_PORT:-$yaml_port}
if [ "$NPROC" = "0" ]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi

# --plan needs no processes: one Python plans for the NPROC that torchrun would start.
for arg in "$@"; do
  case "$arg" in --plan|--dry_run) exec "$PY" main.py --config "$CONFIG" --nproc "$NPROC" "$@" ;; esac
done
# Bad settings fail here, with one line, before any process group exists.
WORLD_SIZE=$NPROC "$PY" main.py --config "$CONFIG" --check_only "$@"
if ! "$PY" -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$MASTER_PORT" 2>/dev/null; then
  echo "error: master_port $MASTER_PORT is in use; set master_port in $CONFIG or MASTER_PORT=<free port>" >&2
  exit 2
fi
# On SIGTERM/SIGINT torchrun forwards the signal and gives the workers this long to finish the
# step and write a checkpoint before it kills them (torch's default, 30 s, is short for 7B+).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
exec "$PY" -m pipeline.launch --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" \
  main.py --config "$CONFIG" "$@"
