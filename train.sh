#!/usr/bin/env bash
# Launch MMoC-Pipe with the settings of fine_tune.yaml (or $CONFIG).
#   bash train.sh                       # the run fine_tune.yaml describes
#   bash train.sh --num_iterations 5    # extra arguments go to main.py and override the YAML
#   bash train.sh --nproc 1 --master_port 29611   # train.sh's own: processes and rendezvous port
# Environment overrides: CONFIG, CUDA_VISIBLE_DEVICES, NPROC, MASTER_PORT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# (a flag wins over its variable).
set -euo pipefail
cd "$(dirname "$0")"
CONFIG=${CONFIG:-fine_tune.yaml}
PY=${PYTHON:-python3}

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then exec "$PY" main.py --config "$CONFIG" --help; fi
done

# The launch settings: a flag, else CUDA_VISIBLE_DEVICES / NPROC / MASTER_PORT, else the YAML.
# Every flag is checked here; a bad one (or a YAML error) is main.py's one line, exit 2.
launch=$("$PY" - "$CONFIG" "$@" <<'PYEOF'
import os, sys
from pipeline.config import ConfigError, launch_settings
try:
    s = launch_settings(["--config", *sys.argv[1:]], os.environ)
except ConfigError as e:
    sys.exit(f"error: {e}")
gpus = s["cuda_visible_devices"]
print("-" if gpus is None else f"={gpus}", s["nproc"], s["master_port"], sep="\n")
PYEOF
) || exit 2
{ read -r gpus; read -r NPROC; read -r MASTER_PORT; } <<< "$launch"
if [ "$gpus" != "-" ]; then
  export CUDA_VISIBLE_DEVICES="${gpus#=}"
fi
GIVEN_NPROC=$NPROC  # 0: not given; --plan then says for how many it plans (another machine's: asks)
if [ "$NPROC" = "0" ]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
# train.sh's own flags are not main.py's business (and torchrun would take --nproc for its own).
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc|--master_port|--cuda_visible_devices) shift 2 ;;
    --nproc=*|--master_port=*|--cuda_visible_devices=*) shift ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- ${args[@]+"${args[@]}"}

# --plan needs no processes: one Python plans for the NPROC that torchrun would start.
for arg in "$@"; do
  case "$arg" in --plan|--dry_run) exec "$PY" main.py --config "$CONFIG" --nproc "$GIVEN_NPROC" "$@" ;; esac
done
# Bad settings fail here, with one line, before any process group exists.
WORLD_SIZE=$NPROC "$PY" main.py --config "$CONFIG" --check_only "$@"
# A listener on the port, not a socket in TIME-WAIT (a run that just ended leaves those; the
# rendezvous binds with SO_REUSEADDR, so they do not stop it).
if "$PY" -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', int(sys.argv[1]))) != 0)" \
    "$MASTER_PORT"; then
  echo "error: master_port $MASTER_PORT is in use; set master_port in $CONFIG, --master_port <port> or" \
    "MASTER_PORT=<free port>" >&2
  exit 2
fi
# On SIGTERM/SIGINT torchrun forwards the signal and gives the workers this long to finish the
# step and write a checkpoint before it kills them (torch's default, 30 s, is short for 7B+).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
exec "$PY" -m pipeline.launch --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" \
  main.py --config "$CONFIG" "$@"
