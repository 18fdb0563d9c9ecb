#!/usr/bin/env bash
# GPU acceptance run (issue: Triton kernels). Needs a CUDA GPU; runs from any directory.
#   tests/gpu/run_all.sh [output dir]
# Stages (STAGES picks them and their order; default "gpu suite deploy memcheck"):
#   gpu       GPU-only acceptance: opcheck on CUDA, CUDA graphs (reduce-overhead) over 300 decode
#             steps, buffers written in place under torch.compile (tests/gpu)
#   suite     the whole test suite on CUDA except the AOTInductor deployment tests (every op and
#             kernel on the GPU against the reference and the golden loops; the CPU tests too), in
#             parallel when pytest-xdist is there
#   deploy    AOTInductor packages on CUDA in a fresh process (tests/gpu/aoti_diag.sh, which keeps
#             the packages and takes a native backtrace of a crash)
#   memcheck  compute-sanitizer memcheck over the GPU kernel tests (every kernel variant)
#   bench     benchmarks.run with $BENCH_ARGS (default "--quick --only step": the whole decode step
#             under one CUDA graph); e.g. BENCH_ARGS="--quick" for the reduced grid, "--only sweep"
#             for the launch-parameter sweep
#   train     benchmarks.train --quick (training ops, forward + backward, CUDA-graph GPU times)
#   profile   Nsight Compute over one launch of each prefill kernel (16K tokens) and of the decode ops
#             that miss 5x (benchmarks/profile.py): ncu.csv, and profile.txt with each kernel's time,
#             DRAM / L2 throughput, occupancy and issue stalls
# SUITE_SHARD=k/n (e.g. 1/2, then 2/2 in a second call): the suite stage runs every n-th test only;
# MEMCHECK_SHARD=k/n the same for the memcheck stage.
# <STAGE>_LIMIT=<seconds> (e.g. SUITE_LIMIT=300) stops a stage with SIGINT after that long, so
# pytest still names every failure so far; tests/gpu/short_run.sh sets limits that fit one
# 10-minute device call. Writes <stage>.log and summary.txt to the output dir.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0
summary() { echo "$*" | tee -a "$out/summary.txt"; }
# limited STAGE cmd...: run cmd under the stage's time limit, if it has one; a stage cut by its
# limit says so in the summary (its counts are then of the tests that ran before the cut)
limited() {
  local var="${1^^}_LIMIT"; shift
  if [ -z "${!var:-}" ]; then "$@"; return; fi
  timeout -s INT "${!var}" "$@"
  local rc=$?
  [ "$rc" -eq 124 ] && cut=", stopped by its ${!var} s limit"
  return "$rc"
}
pytest_result() { grep -E '[0-9]+ (passed|failed)' "$1" | tail -1; }
# shard k/n < a --collect-only listing: every n-th test id, from the k-th (SUITE_SHARD, MEMCHECK_SHARD)
shard() { grep '::' | awk -v k="${1%/*}" -v n="${1#*/}" '(NR - 1) % n == k - 1'; }
: > "$out/summary.txt"
summary "$(nvidia-smi -L | head -1) | $("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

for stage in ${STAGES:-gpu suite deploy memcheck}; do
  start=$(date +%s)
  cut=""
  case "$stage" in
    gpu)
      limited gpu "$py" -m pytest -q tests/gpu -p no:cacheprovider -rA -s > "$out/gpu.log" 2>&1 || status=1
      result="$(pytest_result "$out/gpu.log")" ;;
    suite)
      workers=""
      # one CPU thread per worker: 14 workers each running torch's default of one thread per core
      # oversubscribe the CPUs many times over, and the CPU-parametrized tests crawl
      "$py" -c "import xdist" 2>/dev/null && workers="-n ${WORKERS:-14}" && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
      # -rfEp names every passed test too, so a run cut by SUITE_LIMIT shows what it did not reach
      # (against the collection in suite-collected.txt)
      "$py" -m pytest -q --collect-only tests --ignore=tests/gpu --ignore=tests/test_deploy.py -p no:cacheprovider \
        > "$out/suite-collected.txt" 2>&1
      # SUITE_SHARD=k/n runs every n-th collected test starting at the k-th, so n device calls
      # together run the whole suite
      targets=(tests --ignore=tests/gpu --ignore=tests/test_deploy.py)
      if [ -n "${SUITE_SHARD:-}" ]; then
        shard "$SUITE_SHARD" < "$out/suite-collected.txt" > "$out/suite-shard.txt"
        mapfile -t targets < "$out/suite-shard.txt"
        summary "suite shard $SUITE_SHARD: ${#targets[@]} tests"
      fi
      limited suite "$py" -m pytest -q "${targets[@]}" -p no:cacheprovider \
        -rfEp --durations=20 $workers > "$out/suite.log" 2>&1 || status=1
      result="$(pytest_result "$out/suite.log")" ;;
    deploy)
      limited deploy bash tests/gpu/aoti_diag.sh "$out/aoti" > "$out/deploy.log" 2>&1 || status=1
      result="$(grep -h -E '[0-9]+ (passed|failed)' "$out/aoti/deploy.log" 2>/dev/null | tr '\n' ';')" ;;
    memcheck)
      if ! command -v compute-sanitizer >/dev/null; then
        summary "memcheck: compute-sanitizer not found"; status=1; continue
      fi
      # MEMCHECK_SHARD=k/n: every n-th of these tests from the k-th (92 tests, about 180 s on an H100)
      mtargets=(tests/test_kernels.py tests/test_decode_step.py tests/test_online.py tests/test_train.py
                -k "kernels and not compile and not variant")
      if [ -n "${MEMCHECK_SHARD:-}" ]; then
        "$py" -m pytest -q --collect-only "${mtargets[@]}" -p no:cacheprovider 2>/dev/null \
          | shard "$MEMCHECK_SHARD" > "$out/memcheck-shard.txt"
        mapfile -t mtargets < "$out/memcheck-shard.txt"
        summary "memcheck shard $MEMCHECK_SHARD: ${#mtargets[@]} tests"
      fi
      limited memcheck compute-sanitizer --tool memcheck --error-exitcode 1 --log-file "$out/memcheck.log" \
        "$py" -m pytest -q "${mtargets[@]}" -p no:cacheprovider -rfEp > "$out/memcheck-pytest.log" 2>&1 || status=1
      result="$(grep -h 'ERROR SUMMARY' "$out/memcheck.log" | tail -1); $(pytest_result "$out/memcheck-pytest.log")" ;;
    bench)
      limited bench "$py" -m benchmarks.run ${BENCH_ARGS:---quick --only step} --out "$out/bench" > "$out/bench.log" 2>&1 \
        || status=1
      result="$(($(wc -l < "$out/bench/benchmarks.csv" 2>/dev/null || echo 1) - 1)) rows" ;;
    profile)
      if ! command -v ncu >/dev/null; then
        summary "profile: ncu not found"; status=1; continue
      fi
      limited profile ncu --clock-control none --profile-from-start off --csv --page details --log-file "$out/ncu.csv" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats "$py" -m benchmarks.profile > "$out/profile.log" 2>&1 || status=1
      "$py" -m benchmarks.profile --summarize "$out/ncu.csv" > "$out/profile.txt" 2>&1 || status=1
      result="$(grep -c '^== kernel' "$out/profile.txt") kernels profiled" ;;
    train)
      limited train "$py" -m benchmarks.train --quick --csv "$out/train.csv" > "$out/train.log" 2>&1 || status=1
      result="$(($(wc -l < "$out/train.csv" 2>/dev/null || echo 1) - 1)) rows" ;;
    *)
      summary "unknown stage $stage"; status=1; continue ;;
  esac
  summary "$stage: $result ($(( $(date +%s) - start )) s$cut)"
done
summary "run_all status: $status"
exit $status
