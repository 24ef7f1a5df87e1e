#!/usr/bin/env bash
# Issue 34's one prepared run on a lent GPU: every GPU-only path once, with its figure.
# Usage (repo root, on the GPU machine): OUT=dir bash benchmarks/gpu_check.sh [gpu_check.py flags]
# Writes OUT/gpu_check.json (rewritten after each measurement), logs, and the CUDA tests' result.
# Wheels the GPU image lacks (torchao for --fp8) travel in .whl/ (docs/benchmarks.md says how).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/vitpod-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# vitpod as `make setup` installs it (editable: the package maps the layout's folders); the
# GPU image has setuptools, and --no-deps/--no-index fetch nothing
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)"
# CUDA variants of the fp16 loss-scaling and outlook-kernel tests (skipped on CPU machines); the
# Triton kernels' CPU cases (the interpreter, slow) ran in CI: deselected here
[ -n "${SKIP_TESTS:-}" ] || timeout 180 python3 -m pytest -q -rs -p no:cacheprovider tests/test_trainer_precision.py \
  tests/test_trainer_outlook.py -k "not (cpu and triton)" 2>&1 | tee "$OUT/pytest.log" | tail -5
timeout "${CHECK_TIMEOUT_S:-480}" python3 benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log" | grep -v Warning
echo "gpu_check rc ${PIPESTATUS[0]}"
