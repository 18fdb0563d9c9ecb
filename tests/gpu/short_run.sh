#!/usr/bin/env bash
# The GPU checks that fit one 10-minute device call: tests/gpu/run_all.sh with a time limit per
# stage (override any of them, e.g. SUITE_LIMIT=400):
#   tests/gpu/short_run.sh OUTDIR
# 1. GPU acceptance (tests/gpu: opcheck on CUDA, CUDA graphs over 300 decode steps, in-place buffers)
# 2. the suite on CUDA except the AOTInductor deployment tests (run_all.sh's deploy stage runs those)
# 3. the whole-decode-step benchmark under one CUDA graph
export STAGES="${STAGES:-gpu suite bench}"
export GPU_LIMIT="${GPU_LIMIT:-150}" SUITE_LIMIT="${SUITE_LIMIT:-300}" BENCH_LIMIT="${BENCH_LIMIT:-100}"
exec bash "$(dirname "$0")/run_all.sh" "${1:-gpu-short}"
