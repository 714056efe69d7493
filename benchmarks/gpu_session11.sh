#!/usr/bin/env bash
# Session 11 (nvidia-h200-x2; NOTES.md runs 53-).  BRANCH is a checkout of branch
# predicated-guard (a git worktree, carried with the call; default scratch/pg).
#   usage: bash benchmarks/gpu_session11.sh suite
#   - main's compiled suite over both GPUs (as run 43), the multi-device files beside it, and
#     the branch's compiled tests/test_backends.py (the predicated Triton launches: the (1,)
#     flag block and the aliased outputs have never lowered) beside both.
#   usage: CASES=... IMPLS=... bash benchmarks/gpu_session11.sh bench
#   - the pipelined benchmark of main on GPU 0 and of the branch on GPU 1 at the same time,
#     each with cuDNN in its own process (compare ratios to cuDNN, not TFLOP/s across GPUs).
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-suite}
BRANCH=${BRANCH:-scratch/pg}

if [ "$PART" = suite ]; then
  PALLAS_FLASH_SPREAD_GPUS=2 timeout "${SUITE_TIMEOUT:-470}" python3 -m pytest -q --compiled \
    -p no:cacheprovider -n "${WORKERS:-26}" --timeout=240 --timeout-method=thread $IGNORE tests \
    > "$OUT/tests.log" 2>&1 &
  SUITE=$!
  timeout "${MULTI_TIMEOUT:-300}" python3 -m pytest -q --compiled -p no:cacheprovider -n 2 \
    $MULTI_FILES > "$OUT/tests_multi.log" 2>&1 &
  MULTI_PID=$!
  (cd "$BRANCH" && CUDA_VISIBLE_DEVICES=1 timeout "${BRANCH_TIMEOUT:-300}" python3 -m pytest -q \
    --compiled -p no:cacheprovider -n 4 --timeout=200 --timeout-method=thread \
    tests/test_backends.py) > "$OUT/tests_branch.log" 2>&1 &
  BRANCH_PID=$!
  wait $SUITE; echo "pytest exit: $?" >> "$OUT/tests.log"
  wait $MULTI_PID; echo "pytest exit: $?" >> "$OUT/tests_multi.log"
  wait $BRANCH_PID; echo "pytest exit: $?" >> "$OUT/tests_branch.log"
fi

if [ "$PART" = bench ]; then
  bench() {  # $1 = GPU, $2 = tree, $3 = log name
    (cd "$2" && CUDA_VISIBLE_DEVICES=$1 timeout "${BENCH_TIMEOUT:-500}" python3 -m pallas_flash.bench \
      --timer pipelined --impls "${IMPLS:-pallas_flash,pallas_flash_mosaic,cudnn}" \
      --cases "${CASES:-2x8192x16x16x128,1x16384x16x16x128}" --iters 20 --iters-bwd 10 \
      --no-plot --out "$R/$3") > "$OUT/$3.log" 2>&1
    echo "bench exit: $?" >> "$OUT/$3.log"
  }
  bench 0 . bench_main &
  MAIN_PID=$!
  [ "${BRANCH_BENCH:-yes}" = skip ] || bench 1 "$BRANCH" bench_branch
  wait $MAIN_PID
fi

if [ "$PART" = probe ]; then
  # benchmarks/guard_probe.py on main (GPU 0) and the branch (GPU 1) at once: the forward's
  # check, unchecked kernel, both in one program, and auto, timed; then Nsight Compute's list of
  # the kernels each launches at 1x16384 causal.
  probe() {  # $1 = GPU, $2 = tree, $3 = log name
    (cd "$2" && export CUDA_VISIBLE_DEVICES=$1 &&
     timeout 150 python3 benchmarks/guard_probe.py --cases "${CASES:-1x16384x16x16x128,2x8192x16x16x128}" --sites &&
     timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary \
       per-kernel python3 benchmarks/guard_probe.py --cases 1x16384x16x16x128 --causal 1 \
       --iters 1) > "$OUT/$3.log" 2>&1
    echo "probe exit: $?" >> "$OUT/$3.log"
  }
  probe 0 . probe_main &
  MAIN_PID=$!
  probe 1 "$BRANCH" probe_branch
  wait $MAIN_PID
fi

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
for f in tests tests_multi tests_branch; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|exit|Error" "$OUT/$f.log" | tail -15; }
done
for f in probe_main probe_branch; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^probe|^sites|exit|Error" "$OUT/$f.log" | cut -c1-200; grep -vE "^==PROF==" "$OUT/$f.log" | grep -E "^\s+[a-zA-Z_].*\(|Invocations|Average|gpu__time" | cut -c1-150 | head -40; }
done
for f in bench_main bench_branch; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -vE "^\s*$" "$OUT/$f.log" | tail -30; }
done
true
