#!/usr/bin/env bash
# The GPU checks that fit one 10-minute device call, each stage bounded by its own time limit
# (SIGINT, so pytest still prints every failure so far):
#   tests/gpu/short_run.sh OUTDIR
# 1. GPU acceptance (tests/gpu: opcheck on CUDA, CUDA graphs over 300 decode steps, in-place buffers)
# 2. the suite on CUDA except the AOTInductor deployment tests (tests/gpu/aoti_diag.sh runs those)
# 3. the whole-decode-step benchmark under one CUDA graph
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-short}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
"$py" -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)' | tee "$out/summary.txt"
start=$(date +%s)
timeout -s INT "${GPU_LIMIT:-150}" "$py" -m pytest -q tests/gpu -p no:cacheprovider -rfE -s > "$out/gpu.log" 2>&1
echo "gpu acceptance: $(grep -E '[0-9]+ (passed|failed)' "$out/gpu.log" | tail -1) ($(( $(date +%s) - start )) s)" | tee -a "$out/summary.txt"
start=$(date +%s)
workers=""
"$py" -c "import xdist" 2>/dev/null && workers="-n ${WORKERS:-14}"
timeout -s INT "${SUITE_LIMIT:-300}" "$py" -m pytest -q tests --ignore=tests/gpu --ignore=tests/test_deploy.py -p no:cacheprovider \
  -rfE $workers 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" > "$out/suite.log"
echo "suite without deploy: $(grep -E '[0-9]+ (passed|failed)' "$out/suite.log" | tail -1) ($(( $(date +%s) - start )) s)" | tee -a "$out/summary.txt"
timeout -s INT "${BENCH_LIMIT:-100}" "$py" -m benchmarks.run --quick --only step --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench step: rc $?" | tee -a "$out/summary.txt"
