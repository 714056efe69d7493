#!/usr/bin/env bash
# Session 7's diagnosis call (one H200, ~4 min): why a fused-backward CTA at 8k costs more per
# step than at 16k. ptxas' report on the fused kernel (registers, spills, serialized wgmma),
# then the on-device trace reduced by benchmarks/fused_profile.py.
#   usage: bash benchmarks/gpu_session7.sh
source "$(dirname "$0")/gpu_common.sh"

mkdir -p "$R/dump"
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$R/dump" timeout 120 python3 benchmarks/mosaic_ptxas.py \
  --kernel bwd --head-dim 128 --causal 1,0 > "$OUT/ptxas.log" 2>&1
echo "ptxas exit: $?" >> "$OUT/ptxas.log"
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$R/dump64" timeout 60 python3 benchmarks/mosaic_ptxas.py \
  --kernel bwd --head-dim 64 --causal 1 >> "$OUT/ptxas.log" 2>&1
echo "ptxas exit: $?" >> "$OUT/ptxas.log"
timeout 150 python3 benchmarks/fused_profile.py --out "$R" --causal 1,0 > "$OUT/profile.log" 2>&1
echo "profile exit: $?" >> "$OUT/profile.log"
mkdir -p "$R/p16"
timeout 100 python3 benchmarks/fused_profile.py --out "$R/p16" --case 2x16384x16x16x128 --causal 1 \
  >> "$OUT/profile.log" 2>&1
echo "profile exit: $?" >> "$OUT/profile.log"

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== ptxas"; grep -E "===|egisters|spill|C75|serializ|rror|exit" "$OUT/ptxas.log" | cut -c1-220 | head -40
echo "== profile"; grep -vE "^\s*$" "$OUT/profile.log" | grep -vE "Warning|warn" | tail -150
