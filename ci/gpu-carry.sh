#!/usr/bin/env bash
# Prepare what ci/gpu-h200.sh needs on a GPU box that has no vllm and no
# network: upstream's unfused MLA decode kernel (the layer-5 baseline) in
# .upstream/, a pyzmq wheel for that box's Python in .whl/, and in .whl-vllm/
# the applied tree's vllm Python as a pure-Python wheel (ci/vllm_py_wheel.py)
# with the packages it imports that the box lacks (ci/gpu-vllm-deps.txt), for
# the GPU tests that run vllm's own code. The folders are git-ignored; pass
# them to the device as carried paths (about 50 MiB together).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=${1:-.work/tree}
if [ ! -f "$tree/vllm/v1/attention/ops/triton_decode_attention.py" ]; then
  PYTHONPATH=build python3 -m k3stack apply --tree "$tree"
fi
rm -rf .whl-vllm
mkdir -p .upstream .whl .whl-vllm
cp "$tree/vllm/v1/attention/ops/triton_decode_attention.py" .upstream/
platforms=()
for tag in 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17; do
  platforms+=(--platform "manylinux_${tag}_x86_64")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 "$@"
}
download -d .whl "pyzmq==27.3.0"
download -d .whl-vllm -r ci/gpu-vllm-deps.txt
PYTHONPATH=build python3 ci/vllm_py_wheel.py "$tree" .whl-vllm
ls .upstream .whl
du -sh .whl-vllm
