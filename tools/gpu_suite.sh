#!/usr/bin/env bash
# The whole GPU verification in one go: doctor, the full test suite with no GPU
# test allowed to skip, the graph dump and every benchmark. Logs go to the
# folder given as the first argument (default ./gpu-logs).
set -uo pipefail
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 DRVTRAIN_REQUIRE_GPU=1
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() {
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$logs/nvidia-smi.log" 2>&1
step doctor python3 -m drvtrain doctor
step pytest python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests}
step dump_graph python3 tools/dump_graph.py --out "$logs/demo.dot"
step overfit python3 tools/overfit.py
for bench in tools/bench_*.py; do
  step "$(basename "$bench" .py)" python3 "$bench"
done
exit $status
