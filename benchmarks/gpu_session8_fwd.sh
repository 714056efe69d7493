#!/usr/bin/env bash
# Session 8's second kind of device call (one H200, ~7 min): the forward with a third V slot
# (MosaicForwardConfig.v_stages, opt-in: run 34's trace had the compute warpgroups waiting for
# V ~0.1 kcycles a step) against the default tiles, kernel alone, head_dim 128 at 8k and 16k
# and head_dim 64 at 8k, both masks; then the benchmark with the pipelined timer on the README's
# cases (cuDNN in the same process).
#   usage: bash benchmarks/gpu_session8_fwd.sh            (TUNE=skip / BENCH=skip to leave out)
source "$(dirname "$0")/gpu_common.sh"

if [ "${TUNE:-yes}" != skip ]; then
  mkdir -p "$R/tune"
  timeout 200 python3 benchmarks/mosaic_tune.py --passes fwd --head-dims 128 --causal 0,1 \
    --seq 8192,16384 --iters 10 --fwd-stages 2 --fwd-pingpong 0 --fwd-overlap 1 \
    --fwd-v-stages 0,3 --out "$R/tune" > "$OUT/tune.log" 2>&1
  echo "tune exit: $?" >> "$OUT/tune.log"
  timeout 90 python3 benchmarks/mosaic_tune.py --passes fwd --head-dims 64 --causal 0,1 \
    --iters 10 --fwd-stages 2 --fwd-pingpong 1 --fwd-overlap 0 --fwd-v-stages 0,3 \
    --out "$R/tune" >> "$OUT/tune.log" 2>&1
  echo "tune exit: $?" >> "$OUT/tune.log"
fi
if [ "${BENCH:-yes}" != skip ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -m pallas_flash.bench --impls pallas_flash,cudnn \
    --timer pipelined --cases "${BENCH_CASES:-2x8192x16x16x128,1x16384x16x16x128,2x8192x32x32x64,2x8192x32x8x128,2x8192x8x8x256}" \
    --iters 20 --iters-bwd 10 --no-plot --out "$R" > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
fi
tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
[ -f "$OUT/tune.log" ] && { echo "== tune"; grep -E "impl=|rror|exit" "$OUT/tune.log" \
  | sed -E 's/MosaicForwardConfig\(block_q=64, //; s/, copy_registers=[0-9]+, profile_dir=..//' \
  | cut -c1-220; }
[ -f "$OUT/bench.log" ] && { echo "== bench"; grep -vE "^\s+[0-9]x|\.\.\.$" "$OUT/bench.log" | tail -30; }
true
