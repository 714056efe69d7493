#!/usr/bin/env bash
# One call on the 2-GPU machine when device time is short: the compiled single-device suite on
# GPU 0 and the benchmark on GPU 1, at the same time. The benchmark's GPU is its own, but the
# host's CPUs are shared with the suite's compiles, so its timings can carry some host jitter
# (every implementation of a row is measured in the same process, side by side).
#   usage: bash benchmarks/gpu_session_split.sh   (env: WORKERS, SUITE_TIMEOUT, SUITE_FILES,
#          PYTEST_EXTRA, BENCH_TIMEOUT, BENCH_ARGS)
source "$(dirname "$0")/gpu_common.sh"

CUDA_VISIBLE_DEVICES=0 timeout "${SUITE_TIMEOUT:-540}" python3 -m pytest -v --compiled \
  -p no:cacheprovider -n "${WORKERS:-24}" ${PYTEST_EXTRA:-} $IGNORE ${SUITE_FILES:-tests} \
  > "$OUT/tests.log" 2>&1 &
SUITE=$!
CUDA_VISIBLE_DEVICES=1 timeout "${BENCH_TIMEOUT:-540}" python3 -m pallas_flash.bench --out "$R" \
  ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 &
BENCH=$!
wait $SUITE; echo "pytest exit: $?" >> "$OUT/tests.log"
wait $BENCH; echo "bench exit: $?" >> "$OUT/bench.log"

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit|Timeout" "$OUT/tests.log" | tail -30
echo "== bench"; tail -45 "$OUT/bench.log"
