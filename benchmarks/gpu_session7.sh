#!/usr/bin/env bash
# Session 7's first kernel call (one H200, ~6 min): the persistent fused backward against the
# grid of one CTA per key tile (whose epilogue now overlaps the writer's last adds), compiled
# tests first.
#   usage: bash benchmarks/gpu_session7.sh
source "$(dirname "$0")/gpu_common.sh"

timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -v --compiled -p no:cacheprovider -n 8 \
  --timeout=140 --timeout-method=thread tests/test_mosaic_fused.py > "$OUT/tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.log"
mkdir -p "$R/seqs" "$R/d64" "$R/gqa"
CFGS=";fused_persistent=1"
timeout 150 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 --iters 5 \
  --seq 4096,8192,16384 --bwd-configs "$CFGS" --out "$R/seqs" > "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"
timeout 60 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 64 --causal 1,0 \
  --bwd-configs "$CFGS" --out "$R/d64" >> "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"
timeout 60 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 --heads 32 \
  --group 4 --bwd-configs "$CFGS" --out "$R/gqa" >> "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/tests.log" | tail -12
echo "== tune"; grep -E "impl=|rror|exit" "$OUT/tune.log" | sed -E 's/ config=MosaicBackwardConfig\(.*fused_persistent=([A-Za-z]+).*\)/ persistent=\1/' | cut -c1-200
