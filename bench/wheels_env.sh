# Sourced by the device-call scripts, from the project root: the carried wheels (.whl, filled by
# ../shared/gpu/wheels.sh and peer_wheels.sh) installed into .whl-site and put on the paths
# (PYTHONPATH; PATH for the ninja wheel's binary, which RoundPipe's and DeepSpeed's JIT builds
# need). $1: the install's log. Nothing where .whl holds no wheel.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl-site .whl/*.whl \
    >"$1" 2>&1 || { echo "wheel install failed (see $1)"; tail -5 "$1"; }
  export PYTHONPATH=$PWD/.whl-site:${PYTHONPATH:-}
  export PATH=$PWD/.whl-site/bin:$PATH
fi
