#!/usr/bin/env bash
# The whole GPU verification in one go: doctor, the full test suite with no GPU
# test allowed to skip, the graph dumps, the step audit, the overfit smoke,
# every benchmark, the per-kernel profile, the replays' stamps and, unless
# SANITIZE=0, compute-sanitizer: memcheck over the GPU test files, memcheck and
# racecheck over a few captured DQN steps of both configurations, and racecheck
# over the block sums, the DQN loss kernels and the wgmma backward products. Logs
# go to the folder given as the first argument (default ./gpu-logs). ONLY=a,b runs
# just those steps.
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
step train_cli python3 -m drvtrain train cartpole --seed 0 --out "$logs/run-cartpole-seed0"
for bench in tools/bench_*.py; do
  step "$(basename "$bench" .py)" python3 "$bench"
done
TAIL=${TAIL_PROFILE:-80} step profile_step python3 tools/profile_step.py
step stamp_replays python3 tools/stamp_replays.py
if [ "${SANITIZE:-1}" = 1 ] && { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",sanitize,"* ]]; }; then
  # One sanitizer process per test file, side by side: the instrumentation costs
  # CPU time, and the files are independent. Tests that make failing driver
  # calls on purpose are deselected (every API error left is a real one), and
  # so are those that count free device memory, which the sanitizer moves.
  san_files="test_kernel_gpu test_memory_gpu test_graph_gpu test_nn_gpu test_sumtree_gpu test_replay_gpu
             test_hardening_gpu test_dqn_gpu test_envs_gpu test_gemm_gpu test_narrow_gpu
             test_launch_options_gpu test_tma_gpu test_reductions_gpu"
  mkdir -p "$logs/sanitizer"
  # A test runs tens of times slower under the sanitizer: its own time limit a test
  # (tests/conftest.py's DRVTRAIN_TEST_TIMEOUT), 4 hours unless SANITIZER_TEST_TIMEOUT says.
  export DRVTRAIN_TEST_TIMEOUT=${SANITIZER_TEST_TIMEOUT:-14400}
  pids=()
  for f in $san_files; do
    "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider -m "not provokes_driver_errors and not counts_device_memory" "tests/$f.py" \
      > "$logs/sanitizer/memcheck_$f.log" 2>&1 &
    pids+=($!)
  done
  for tool in memcheck racecheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 \
      python3 tools/audit_step.py --steps 3 > "$logs/sanitizer/${tool}_dqn_step.log" 2>&1 &
    pids+=($!)
  done
  # The wgmma backward's warpgroups hand shared memory over by named barriers:
  # racecheck over its products (all but the largest shape, for time) and its
  # edge cases (a split with no k tile, exactly three k tiles).
  "$sanitizer" --tool racecheck --error-exitcode 1 --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider tests/test_gemm_gpu.py \
    -k "(test_product_matches_float64 and wgmma and grad and not 512x1024x1024) or test_wgmma_backward_on_splits" \
    > "$logs/sanitizer/racecheck_wgmma_backward.log" 2>&1 &
  pids+=($!)
  # The block sums hand values between warps through shared memory, and the DQN
  # loss kernels stage their rows there with asynchronous copies.
  "$sanitizer" --tool racecheck --error-exitcode 1 --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider tests/test_reductions_gpu.py tests/test_dqn_gpu.py \
    -k "block_sums or head_kernel" > "$logs/sanitizer/racecheck_block_sums.log" 2>&1 &
  pids+=($!)
  san_status=0
  for pid in "${pids[@]}"; do wait "$pid" || san_status=1; done
  for log in "$logs"/sanitizer/*.log; do
    printf '%-40s %s | %s\n' "$(basename "$log" .log)" \
      "$(grep -h 'ERROR SUMMARY' "$log" | tail -n 1)" "$(grep -hE 'passed|failed|all criteria|FAIL' "$log" | tail -n 1)"
  done
  [ "$san_status" -eq 0 ] || { echo "=== sanitizer: errors or failures (logs in $logs/sanitizer)"; status=1; }
fi
exit $status
