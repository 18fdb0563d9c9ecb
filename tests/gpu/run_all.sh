#!/usr/bin/env bash
# Full GPU acceptance run (issue: Triton kernels). Needs a CUDA GPU; runs from any directory.
#   tests/gpu/run_all.sh [output dir]
# 1. the whole test suite on CUDA (every op and kernel on the GPU against the reference and the
#    golden loops; the CPU tests too; AOTInductor packages on CUDA in a fresh process,
#    tests/test_deploy.py), in parallel when pytest-xdist is there
# 2. GPU-only acceptance: opcheck on CUDA, CUDA graphs (reduce-overhead) over 300 decode steps,
#    buffers written in place under torch.compile
# 3. compute-sanitizer memcheck over the GPU kernel tests (every kernel variant)
# Writes suite.log, gpu.log, memcheck.log and summary.txt to the output dir.
# STAGES="suite gpu memcheck" (the default) picks stages, e.g. to split the run over calls
# that each have a time limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
summary "$(nvidia-smi -L | head -1) | $("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

stages=" ${STAGES:-suite gpu memcheck} "

if [[ "$stages" == *" suite "* ]]; then
  workers=""
  "$py" -c "import xdist" 2>/dev/null && workers="-n 8"
  start=$(date +%s)
  "$py" -m pytest -q tests --ignore=tests/gpu -p no:cacheprovider $workers 2>&1 | tee "$out/suite.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  summary "suite: $(grep -E '[0-9]+ (passed|failed)' "$out/suite.log" | tail -1) ($(( $(date +%s) - start )) s)"
fi

if [[ "$stages" == *" gpu "* ]]; then
  start=$(date +%s)
  "$py" -m pytest -q tests/gpu -p no:cacheprovider -rA -s 2>&1 | tee "$out/gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|peak growth" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  summary "gpu acceptance: $(grep -E '[0-9]+ (passed|failed)' "$out/gpu.log" | tail -1) ($(( $(date +%s) - start )) s)"
fi

if [[ "$stages" == *" memcheck "* ]]; then
  if command -v compute-sanitizer >/dev/null; then
    start=$(date +%s)
    compute-sanitizer --tool memcheck --error-exitcode 1 --log-file "$out/memcheck.log" \
      "$py" -m pytest -q tests/test_kernels.py tests/test_decode_step.py tests/test_online.py tests/test_train.py \
      -k "kernels and not compile and not variant" -p no:cacheprovider 2>&1 | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    summary "memcheck: $(grep -h 'ERROR SUMMARY' "$out/memcheck.log" | tail -1) ($(( $(date +%s) - start )) s)"
  else
    summary "compute-sanitizer not found"; status=1
  fi
fi
summary "run_all status: $status"
exit $status
