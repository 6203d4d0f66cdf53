#!/usr/bin/env bash
# GPU qualification on a CUDA machine that has torch, triton, numpy and pytest
# but no vllm (the lent H200): every GPU-marked test file (those that run
# vllm's own code with the stack's vllm Python from .whl-vllm/), then the GPU
# benchmarks. Logs and JSON go to $OUT (default dist/gpu). pyzmq, if missing,
# comes from wheels in .whl/. Prepare .upstream/, .whl/ and .whl-vllm/ with
# ci/gpu-carry.sh.
set -uo pipefail
OUT=${OUT:-dist/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import zmq" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/k3-site .whl/*.whl
  export PYTHONPATH=/tmp/k3-site
fi
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv \
  > "$OUT/smi.txt" || { echo "gpu-h200: nvidia-smi failed: no usable GPU"; status=1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  > "$OUT/versions.txt" || status=1
# overlay/ on the path makes the layer modules that need no compiled vllm
# (vllm.k3_draft: server, engines) importable as a namespace package.
export PYTHONPATH="$PWD/overlay${PYTHONPATH:+:$PYTHONPATH}"
# Tests for more GPUs than this machine has are deselected (said in one
# line); any other skip fails the run: a GPU test that did not run (a
# missing .upstream/ copy, no CUDA) is not a pass.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" || echo 0)
marks="gpu"
if [ "$gpus" -lt 2 ]; then
  marks="gpu and not multi_gpu"
  echo "gpu-h200: $gpus GPU(s): multi_gpu tests deselected"
fi
timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m "$marks" \
  tests/layer1/test_reference_engine.py tests/layer1/test_reference_oracle.py \
  tests/layer2/test_topk_graphs_gpu.py \
  tests/layer2/test_topk_select.py \
  tests/layer3/test_stream_gate_gpu.py \
  tests/layer4/test_slot_mapping_gpu.py tests/layer5/test_fused_mla_verify_gpu.py \
  2>&1 | tee "$OUT/gpu-tests.txt" | tail -20 || status=1
if grep -Eq "[0-9]+ skipped" "$OUT/gpu-tests.txt"; then
  echo "gpu-h200: GPU tests were skipped (see $OUT/gpu-tests.txt): failing"
  status=1
fi
# GPU tests that run vllm's own code (the production engine against
# upstream's Qwen3 and Kimi-K3 MLA draft model classes, layer 3 through the
# runner, layer 5 through the metadata builder and the MLA impl): with the
# stack installed, as it is; on a box without vllm, the stack's vllm Python
# and the packages it imports, carried in .whl-vllm/ (ci/gpu-carry.sh), in a
# site of their own in front of the path (no compiled extensions: its platform
# plugin keeps vLLM on its platform-neutral code).
vllm_path=""
vllm_tests=1
if ! python3 -c "import vllm.v1.worker.gpu.model_runner" >/dev/null 2>&1; then
  if ls .whl-vllm/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/k3-vllm-site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/k3-vllm-site \
      .whl-vllm/*.whl 2>&1 | grep -v "pip as the 'root' user"
    vllm_path=/tmp/k3-vllm-site
  else
    echo "gpu-h200: vllm is not importable and there is no .whl-vllm/ (ci/gpu-carry.sh): the GPU tests of vllm's own code cannot run: failing"
    status=1
    vllm_tests=0
  fi
fi
if [ "$vllm_tests" = 1 ]; then
  PYTHONPATH="${vllm_path:+$vllm_path:}$PYTHONPATH" timeout 300 python3 -m pytest -q -rfEs \
    -p no:cacheprovider -m "$marks" tests/layer1/test_production_engine_upstream.py \
    tests/layer1/test_production_engine_upstream_mla.py \
    tests/layer2/test_remote_draft_logits_gpu.py \
    tests/layer3/test_deferred_resolve_gpu.py \
    tests/layer5/test_verify_routing_gpu.py \
    2>&1 | tee "$OUT/gpu-tests-vllm.txt" | tail -20 || status=1
  if grep -Eq "[0-9]+ skipped" "$OUT/gpu-tests-vllm.txt"; then
    echo "gpu-h200: GPU tests were skipped (see $OUT/gpu-tests-vllm.txt): failing"
    status=1
  fi
fi
# Multi-rank checks (TP broadcast, DCP merge, replicated draft) at every
# power-of-two world size the GPUs allow, NCCL with NVLink multicast off; the
# TP broadcast through the real speculator and vLLM's TP group where vllm's
# Python is there (installed, or carried in .whl-vllm/).
sizes=""
for n in 1 2 4 8; do
  if [ "$n" -le "$gpus" ]; then sizes="${sizes:+$sizes,}$n"; fi
done
[ -n "$sizes" ] || { echo "gpu-h200: no CUDA device for the multi-rank checks"; status=1; }
PYTHONPATH="${vllm_path:+$vllm_path:}$PYTHONPATH" timeout 300 python3 ci/multi_rank.py \
  --world-sizes "$sizes" --out "$OUT/multi-rank.json" \
  2>&1 | tee "$OUT/multi-rank.txt" | tail -20 || status=1
if [ "${K3_GPU_BENCH:-1}" = 1 ]; then
  timeout 200 python3 bench/bench_deferred_resolve.py --steps 60 \
    --out "$OUT/deferred.json" 2>&1 | tee "$OUT/bench-deferred.txt" | tail -30 || status=1
fi
exit $status
