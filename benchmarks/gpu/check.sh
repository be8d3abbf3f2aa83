#!/usr/bin/env bash
# The CUDA checks (issue 34), on a machine with an NVIDIA GPU whose python3 has torch (CUDA) and transformers:
# installs the engine's other dependencies from wheels carried in .whl/ (no network there), then
#   1. the exactness matrix on CUDA: tests/test_exactness_greedy.py and test_exactness_sampling.py with the tiny
#      random models on the GPU (SSR_TEST_DEVICE=cuda, float32, TF32 off), the scheduler's tests (concurrent requests
#      identical to each alone, cancellation) and the device tests that skip on a CPU;
#   2. greedy agreement in bf16 on the same cases and models (bf16_agreement.py);
#   3. the step costs of models shaped like Qwen2.5-Coder-0.5B and 1.5B, bf16 and float32 (calibrate_shapes.py).
# Everything it writes goes to $OUT (default gpu-out).
#
#   bash benchmarks/gpu/check.sh            (wheels: pip download ... -d .whl, see docs/backends/transformers.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ssr-site .whl/*.whl \
  || { echo "check: carried wheels did not install"; exit 1; }
export PYTHONPATH="/tmp/ssr-site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} | tee "$OUT/machine.txt"
start=$(date +%s)
SSR_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -rxs -p no:cacheprovider -n 8 \
  tests/test_exactness_greedy.py tests/test_exactness_sampling.py tests/test_scheduler.py tests/test_device.py 2>&1 | tee "$OUT/cuda_tests.log"
echo "check: CUDA tests $(( $(date +%s) - start )) s" | tee -a "$OUT/machine.txt"
SSR_TEST_DEVICE=cuda timeout 120 python3 benchmarks/gpu/bf16_agreement.py "$OUT" 2>&1 | tee "$OUT/bf16.log"
start=$(date +%s)
timeout 240 python3 benchmarks/gpu/calibrate_shapes.py "$OUT" 2>&1 | tee "$OUT/calibrate.log"
echo "check: calibration $(( $(date +%s) - start )) s" | tee -a "$OUT/machine.txt"
