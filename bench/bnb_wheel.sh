#!/usr/bin/env bash
# bitsandbytes for the GPU machines (load_in_4bit), which cannot install from the network: its
# 0.50.2 wheel (43 MB, every CUDA, ROCm and XPU build of its library) with the project and the other
# wheels is over the 64 MiB a device call can carry. This fetches it here and repacks it into .whl/
# at the project root (.gitignore, next to what ../shared/gpu/wheels.sh fetches) keeping only the
# CPU library and the CUDA one the GPU machine's torch loads: torch 2.11.0+cu130 reports CUDA 13.0,
# and bitsandbytes picks libbitsandbytes_cuda130.so for it (BNB_CUDA=130 to keep another). The
# wheel's RECORD loses the dropped files' lines, so pip installs it. Install it there as
# bench/wheels_env.sh does (one --target for all of .whl).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
mkdir -p .whl
cuda=${BNB_CUDA:-130}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp" "bitsandbytes==0.50.2"
wheel=$(ls "$tmp"/bitsandbytes-0.50.2-*.whl)
python3 - "$wheel" ".whl/$(basename "$wheel")" "libbitsandbytes_cuda$cuda.so" <<'PY'
import sys, zipfile

src, dst, keep = sys.argv[1:]
libs = ("libbitsandbytes_cpu.so", keep)


def dropped(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith("libbitsandbytes_") and base.endswith(".so") and base not in libs


with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    if not any(n.endswith("/" + keep) for n in names):
        sys.exit(f"{src} has no {keep}")
    for info in zin.infolist():
        if dropped(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(line for line in lines if not dropped(line.split(",", 1)[0])) + "\n").encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{dst}: kept {', '.join(libs)}")
PY
ls -l ".whl/$(basename "$wheel")"
