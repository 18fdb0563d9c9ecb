#!/usr/bin/env bash
# Full GPU acceptance run (issue: Triton kernels). Needs a CUDA GPU.
#   tests/gpu/run_all.sh [output dir]
# 1. the whole test suite on CUDA (every op on the GPU against the reference and the golden loops)
# 2. GPU-only tests: opcheck on CUDA, CUDA graphs (reduce-overhead) over 300 decode steps,
#    in-place buffers under torch.compile, AOTInductor package in a fresh process
# 3. compute-sanitizer memcheck over the GPU kernel tests
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
python -m pytest -q tests -x --ignore=tests/gpu -p no:cacheprovider 2>&1 | tee "$out/suite.log" | tail -5 || status=1
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu.log" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 1 --log-file "$out/memcheck.log" \
    python -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  grep -h "ERROR SUMMARY" "$out/memcheck.log" | tail -1
else
  echo "compute-sanitizer not found"; status=1
fi
echo "run_all status: $status"
exit $status
