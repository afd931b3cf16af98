#!/usr/bin/env bash
# The whole GPU verification in one go: doctor, the full test suite with no GPU
# test allowed to skip, the graph dumps, the step audit, the overfit smoke,
# every benchmark and, unless SANITIZE=0, compute-sanitizer memcheck over the
# driver, engine and replay tests plus memcheck and racecheck over a few
# captured DQN steps of both configurations. Logs go to the folder given as
# the first argument (default ./gpu-logs). ONLY=a,b runs just those steps.
set -uo pipefail
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 DRVTRAIN_REQUIRE_GPU=1
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
sanitizer=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
status=0
step() {
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  echo "=== $name: $*"
  local started=$SECONDS
  "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$logs/$name.log"
  echo "=== $name exit $rc ($((SECONDS - started)) s)"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$logs/nvidia-smi.log" 2>&1
step doctor python3 -m drvtrain doctor
step pytest python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests}
step dump_graph python3 tools/dump_graph.py --out "$logs/demo.dot" --no-svg
step dump_dqn python3 tools/dump_graph.py --what dqn-small --out "$logs/dqn-small.dot" --no-svg
step audit python3 tools/audit_step.py
step overfit python3 tools/overfit.py
for bench in tools/bench_*.py; do
  step "$(basename "$bench" .py)" python3 "$bench"
done
if [ "${SANITIZE:-1}" = 1 ]; then
  san_tests="tests/test_kernel_gpu.py tests/test_memory_gpu.py tests/test_graph_gpu.py tests/test_nn_gpu.py
             tests/test_sumtree_gpu.py tests/test_replay_gpu.py tests/test_hardening_gpu.py"
  step memcheck_tests "$sanitizer" --tool memcheck --error-exitcode 1 --target-processes all \
    python3 -m pytest -q -p no:cacheprovider -x $san_tests
  for tool in memcheck racecheck; do
    step "${tool}_dqn" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      python3 tools/audit_step.py --steps 3
  done
fi
exit $status
