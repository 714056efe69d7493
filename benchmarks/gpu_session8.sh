#!/usr/bin/env bash
# The next session's first device call (one H200, ~8 min), prepared in session 7 (NOTES.md,
# "Next GPU session: the plan", items 1, 2 and 5):
#   1. compiled tests of the fused backward, incl. the opt-in early slot release and the
#      overlap of P^T with the dP^T product;
#   2. where ptxas spills in the fused kernel (SASS grepped here: the dumps are too large to
#      bring back);
#   3. early release, overlap and a register split against the default, kernel alone, 8k
#      (and the default against both opt-ins at 16k);
#   4. the forward's on-device trace (kernel_trace.py).
#   usage: bash benchmarks/gpu_session8.sh
source "$(dirname "$0")/gpu_common.sh"

timeout 170 python3 -m pytest -v --compiled -p no:cacheprovider -n 8 --timeout=160 \
  --timeout-method=thread tests/test_mosaic_fused.py > "$OUT/tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.log"

D=/tmp/sass_dump
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$D timeout 80 python3 \
  benchmarks/mosaic_ptxas.py --kernel bwd --head-dim 128 --causal 1 > /tmp/ptxas.log 2>&1
{
  echo "ptxas exit: $?"
  grep -rhE "Used [0-9]+ registers|spill" /tmp/ptxas.log $D 2>/dev/null | sort | uniq -c
  # Each local-memory access with the 30 lines before it (the region it sits in).
  for f in $(grep -rlE "STL|LDL" $D 2>/dev/null | head -2); do
    echo "== $f"; grep -nE "STL|LDL" "$f" | head -40
    grep -nE "STL|LDL" "$f" | head -3 | cut -d: -f1 | while read -r n; do
      sed -n "$((n > 30 ? n - 30 : 1)),${n}p" "$f"; echo ----; done
  done
} > "$OUT/spills.txt" 2>&1

mkdir -p "$R/tune" "$R/tune16" "$R/trace"
timeout 160 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 \
  --iters 5 --seq 8192 --out "$R/tune" --bwd-configs \
  ";fused_early_release=1;fused_overlap=1;fused_early_release=1,fused_overlap=1;compute_registers=224" \
  > "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"
timeout 80 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 \
  --iters 5 --seq 16384 --out "$R/tune16" --bwd-configs ";fused_early_release=1,fused_overlap=1" \
  >> "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"
timeout 60 python3 benchmarks/kernel_trace.py --pass fwd --causal 0,1 --out "$R/trace" \
  > "$OUT/trace.log" 2>&1
echo "trace exit: $?" >> "$OUT/trace.log"

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/tests.log" | tail -12
echo "== spills"; head -60 "$OUT/spills.txt" | cut -c1-160
echo "== tune"; grep -E "impl=|rror|exit" "$OUT/tune.log" | sed -E \
  's/ config=MosaicBackwardConfig\(.*compute_registers=([0-9]+).*fused_early_release=([A-Za-z]+), fused_overlap=([A-Za-z]+).*\)/ regs=\1 early=\2 overlap=\3/' \
  | cut -c1-200
echo "== trace"; grep -E "exit|kcyc|order|r2|\"ms\"|causal" "$OUT/trace.log" | head -80
