#!/usr/bin/env bash
# AOTInductor deployment on a GPU, with what it takes to find a crash at package load.
#   tests/gpu/aoti_diag.sh [output dir] [pytest -k expression for the deployed configs, default "cuda"]
# (AOTI_CONSTANTS=0 skips the module-buffer variant, e.g. to spend a short device call on one config)
# 1. versions;
# 2. tests/test_deploy.py on CUDA, keeping packages, jobs and fresh-process logs
#    (DSV4OPS_DEPLOY_ARTIFACTS, default /tmp/dsv4ops-aoti);
# 3. every fresh-process job that died of a signal is run again under cuda-gdb (the H200 image
#    has no gdb; cuda-gdb debugs host code too) for a native backtrace.
# Output files (three: a device call returns at most eight): deploy.log (versions first), fresh-logs.txt, gdb.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-aoti-diag}"
expr="${2:-cuda}"
art="${DSV4OPS_DEPLOY_ARTIFACTS:-/tmp/dsv4ops-aoti}"
py="${PYTHON:-python3}"
mkdir -p "$out" "$art"
export PYTHONUNBUFFERED=1 DSV4OPS_DEPLOY_ARTIFACTS="$art"
{
  nvidia-smi -L
  "$py" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$out/deploy.log" 2>&1
cat "$out/deploy.log"
# the module-buffer (AOTI constants) variant first and on its own: a crash of the in-process load
# test further on kills pytest, and the fresh-process logs written so far survive it
status=0
if [ "${AOTI_CONSTANTS:-1}" != 0 ]; then
  "$py" -m pytest -q tests/test_deploy.py -k "constants and cuda" -p no:cacheprovider -rA 2>&1 | tee -a "$out/deploy.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
"$py" -m pytest -q tests/test_deploy.py -k "($expr) and not constants" -p no:cacheprovider -rA 2>&1 | tee -a "$out/deploy.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
: > "$out/fresh-logs.txt"
: > "$out/gdb.txt"
for log in "$art"/*/*-log.txt; do
  [ -e "$log" ] || continue
  { echo "=== $log"; cat "$log"; } >> "$out/fresh-logs.txt"
  rc=$(head -1 "$log" | awk '{print $2}')
  if [ "${rc:-0}" -lt 0 ] 2>/dev/null && command -v cuda-gdb > /dev/null; then
    echo "=== $log (returncode $rc) under cuda-gdb" >> "$out/gdb.txt"
    timeout 300 cuda-gdb -batch -ex run -ex "thread apply all bt 40" \
      --args "$py" -X faulthandler tests/_aoti_runner.py "${log%-log.txt}-job.pt" /tmp/dsv4ops-gdb-result.pt \
      >> "$out/gdb.txt" 2>&1
  fi
done
echo "aoti_diag status: $status"
exit "$status"
