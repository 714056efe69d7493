#!/usr/bin/env bash
# Session 7's last call (one H200, ~7 min): ptxas' report on the fused backward (grepped here:
# the dumps are too large to bring back), then the benchmark with the pipelined timer on the
# head_dim 128, 64, 256 and GQA cases.
#   usage: bash benchmarks/gpu_session7_bench.sh
source "$(dirname "$0")/gpu_common.sh"

MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas_dump timeout 70 python3 \
  benchmarks/mosaic_ptxas.py --kernel bwd --head-dim 128 --causal 1 > /tmp/ptxas.log 2>&1
echo "ptxas exit: $?" > "$OUT/ptxas.txt"
grep -E "^===" /tmp/ptxas.log >> "$OUT/ptxas.txt"
grep -rhE "Used [0-9]+ registers|spill|C75[0-9][0-9]|serializ" /tmp/ptxas.log /tmp/ptxas_dump 2>/dev/null \
  | sort | uniq -c | head -40 >> "$OUT/ptxas.txt"
ls /tmp/ptxas_dump | head -20 >> "$OUT/ptxas.txt"
timeout 430 python3 -m pallas_flash.bench --impls pallas_flash,cudnn --timer pipelined \
  --cases 2x8192x16x16x128,1x16384x16x16x128,2x8192x32x32x64,2x8192x32x8x128,2x8192x8x8x256 \
  --iters 20 --iters-bwd 10 --no-plot --out "$R" > "$OUT/bench.log" 2>&1
echo "bench exit: $?" >> "$OUT/bench.log"
tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== ptxas"; cut -c1-200 "$OUT/ptxas.txt"
echo "== bench"; grep -vE "^\s+[0-9]x|\.\.\.$" "$OUT/bench.log" | tail -30
