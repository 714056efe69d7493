#!/usr/bin/env bash
# One device call on the 2-GPU machine (nvidia-h200-x2): everything a kernel change must prove.
#   usage: bash benchmarks/gpu_session_x2.sh
# Phase 1, concurrently (the tests are compile-bound, so they share the GPUs well):
#   - the compiled suite minus the multi-device files, each pytest worker on one GPU;
#   - the multi-device files (sharding, ring attention) with both GPUs visible;
#   - benchmarks/huge_check.py (1M tokens x 32 heads: > 2^31 elements per tensor) on GPU 1;
#   - benchmarks/mosaic_check.py (the draft Mosaic GPU forward: does it compile, is it right) on
#     GPU 0, its timings only indicative here (the suite shares the GPU).
# Phase 2, alone on the machine (timings): benchmarks/scaling.py (1 GPU against 2), then a short
# benchmark of our kernels against cuDNN in the same process.
# Logs go to $OUT; JSON results are packed into one results.tar.gz (the tool returns 8 files).
source "$(dirname "$0")/gpu_common.sh"

PALLAS_FLASH_SPREAD_GPUS=2 timeout "${SUITE_TIMEOUT:-330}" python3 -m pytest -v --compiled \
  -p no:cacheprovider -n "${WORKERS:-26}" ${PYTEST_EXTRA:-} $IGNORE ${SUITE_FILES:-tests} \
  > "$OUT/tests.log" 2>&1 &
SUITE=$!
[ "${MULTI:-yes}" = skip ] || timeout "${MULTI_TIMEOUT:-300}" python3 -m pytest -v --compiled -p no:cacheprovider -n 2 $MULTI_FILES \
  > "$OUT/tests_multi.log" 2>&1 &
MULTI_PID=$!
[ "${HUGE:-yes}" = skip ] || CUDA_VISIBLE_DEVICES=1 timeout "${HUGE_TIMEOUT:-320}" \
  python3 benchmarks/huge_check.py --out "$R" ${HUGE_ARGS:-} > "$OUT/huge.log" 2>&1 &
HUGE_PID=$!
# The Mosaic checks run one after the other (forward, then backward), each under its own limit.
[ "${MOSAIC:-yes}" = skip ] || (
  CUDA_VISIBLE_DEVICES=${MOSAIC_GPU:-0} timeout "${MOSAIC_TIMEOUT:-170}" \
    python3 benchmarks/mosaic_check.py --out "$R" > "$OUT/mosaic.log" 2>&1
  echo "mosaic_check exit: $?" >> "$OUT/mosaic.log"
  [ "${MOSAIC_BWD:-yes}" = skip ] || CUDA_VISIBLE_DEVICES=${MOSAIC_GPU:-0} \
    timeout "${MOSAIC_BWD_TIMEOUT:-240}" python3 benchmarks/mosaic_bwd_check.py --out "$R" \
    >> "$OUT/mosaic.log" 2>&1
  echo "mosaic_bwd_check exit: $?" >> "$OUT/mosaic.log"
) &
MOSAIC_PID=$!
wait $SUITE; echo "pytest exit: $?" >> "$OUT/tests.log"
wait $MULTI_PID; echo "pytest exit: $?" >> "$OUT/tests_multi.log"
wait $HUGE_PID; echo "huge_check exit: $?" >> "$OUT/huge.log"
wait $MOSAIC_PID

[ "${SCALING:-yes}" = skip ] || XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${SCALING_TIMEOUT:-140}" python3 benchmarks/scaling.py \
  --out "$R" ${SCALING_ARGS:-} > "$OUT/scaling.log" 2>&1
[ "${SCALING:-yes}" = skip ] || echo "scaling exit: $?" >> "$OUT/scaling.log"
if [ "${BENCH:-yes}" != skip ]; then
  CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_TIMEOUT:-100}" python3 -m pallas_flash.bench --out "$R" \
    --cases "${BENCH_CASES:-2x8192x16x16x128,2x8192x8x8x256}" --impls pallas_flash,cudnn \
    --iters 10 --iters-bwd 5 --no-plot ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
fi

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
for f in tests tests_multi; do
  echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/$f.log" | tail -15
done
echo "== huge"; tail -25 "$OUT/huge.log"
echo "== mosaic"; grep -E "FAIL|exit|TFLOP|PASS.*speed" "$OUT/mosaic.log" | tail -30
echo "== scaling"; tail -25 "$OUT/scaling.log"
echo "== bench"; tail -25 "$OUT/bench.log"
