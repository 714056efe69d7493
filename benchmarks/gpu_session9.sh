#!/usr/bin/env bash
# Session 9, part 1 (one H200, ~4 min): what the head_dim 256 backward spends, per kernel.
#   usage: bash benchmarks/gpu_session9.sh probe
#   - Nsight Compute's metric names for the tensor pipes on this chip (never queried before);
#   - per-kernel duration and SM / tensor-pipe use of the two head_dim 256 backward kernels
#     (dK/dV, dQ), causal and not, 2x8192x8x256 (the benchmark's case, 0.75x cuDNN causal);
#   - the same counters for the fused head_dim 128 backward and the forward (NOTES.md plan 3).
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-probe}

if [ "$PART" = probe ]; then
  ncu --query-metrics --chip gh100 > "$OUT/ncu_metrics_all.txt" 2>&1
  grep -iE "pipe_tensor|gmma" "$OUT/ncu_metrics_all.txt" > "$OUT/ncu_metrics.txt"
  METRICS=$(grep -oE "^sm__pipe_tensor_op_(gmma|hmma)_cycles_active" "$OUT/ncu_metrics_all.txt" \
    | sort -u | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
  echo "metrics: $METRICS" > "$OUT/ncu.txt"
  MET=${METRICS:+--metrics $METRICS}
  for c in 1 0; do
    echo "=== d256 bwd causal=$c" >> "$OUT/ncu.txt"
    timeout 100 ncu --clock-control none -k regex:pallas_flash_mosaic_bwd -c 2 \
      --section SpeedOfLight --section Occupancy $MET \
      python3 benchmarks/mosaic_ptxas.py --head-dim 256 --kernel bwd --causal $c \
      >> "$OUT/ncu.txt" 2>&1
    echo "ncu exit: $?" >> "$OUT/ncu.txt"
  done
  for k in "bwd_fused:--kernel bwd --causal 0" "mosaic_fwd:--kernel fwd --overlap default"; do
    echo "=== d128 ${k%%:*}" >> "$OUT/ncu.txt"
    timeout 80 ncu --clock-control none -k "regex:${k%%:*}" -c 1 --section SpeedOfLight $MET \
      python3 benchmarks/mosaic_ptxas.py --head-dim 128 ${k#*:} >> "$OUT/ncu.txt" 2>&1
    echo "ncu exit: $?" >> "$OUT/ncu.txt"
  done
fi

if [ "$PART" = paired ]; then
  # The paired head_dim 256 dK/dV kernel (MosaicBackwardConfig.dkdv_paired): compiled tests,
  # then kernel-alone timing against the unpaired default and cuDNN.
  timeout 200 python3 -m pytest -q --compiled -p no:cacheprovider -n 4 --timeout=180 \
    --timeout-method=thread tests/test_mosaic_backward.py -k paired > "$OUT/tests.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/tests.log"
  mkdir -p "$R/tune256"
  timeout 150 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 256 --causal 1,0 \
    --iters 5 --out "$R/tune256" --bwd-configs "${CONFIGS:-;dkdv_paired=1}" > "$OUT/tune.log" 2>&1
  echo "tune exit: $?" >> "$OUT/tune.log"
fi

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
[ -f "$OUT/tests.log" ] && { echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit|Error" "$OUT/tests.log" | tail -12; }
[ -f "$OUT/tune.log" ] && { echo "== tune"; grep -E "impl=|rror|exit|TFLOP" "$OUT/tune.log" | sed -E 's/MosaicBackwardConfig\(.*dkdv_paired=([A-Za-z]+)\)/paired=\1/' | cut -c1-220; }
[ -f "$OUT/ncu.txt" ] && echo "== ncu" && grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" "$OUT/ncu.txt" \
  | grep -E "===|exit|metrics|Throughput|tensor|Duration|Registers|Achieved Occ|pallas|Elapsed" \
  | cut -c1-150 | head -90
