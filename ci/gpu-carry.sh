#!/usr/bin/env bash
# Prepare what ci/gpu-h200.sh needs on a GPU box that has no vllm and no
# network: upstream's unfused MLA decode kernel (the layer-5 baseline) in
# .upstream/, and a pyzmq wheel for that box's Python in .whl/. Both folders
# are git-ignored; pass them to the device as carried paths.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=${1:-.work/tree}
if [ ! -f "$tree/vllm/v1/attention/ops/triton_decode_attention.py" ]; then
  PYTHONPATH=build python3 -m k3stack apply --tree "$tree"
fi
mkdir -p .upstream .whl
cp "$tree/vllm/v1/attention/ops/triton_decode_attention.py" .upstream/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "pyzmq==27.3.0"
ls .upstream .whl
