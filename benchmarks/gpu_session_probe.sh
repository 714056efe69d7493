#!/usr/bin/env bash
# One device call on one H200 (~8 min): the backward questions session 6 left (NOTES.md, "Next
# GPU session: the plan", items 1-3), each under its own limit so one hang costs only its share.
#   usage: bash benchmarks/gpu_session_probe.sh
#   1. compiled tests of the fused backward and the backends (d6e2f94's stream-order choice);
#   2. benchmarks/backward_gap.py: the public backward's layers, pipelined and per call;
#   3. the fused backward at four lengths, causal and not (per-step against per-CTA cost), and
#      at 64 heads (a smaller tail);
#   4. the GQA 32:8 kernel alone (head-major without a mask, block-major causal) and its bench row.
source "$(dirname "$0")/gpu_common.sh"

timeout "${TEST_TIMEOUT:-160}" python3 -m pytest -v --compiled -p no:cacheprovider -n 8 \
  --timeout=150 --timeout-method=thread tests/test_mosaic_fused.py tests/test_backends.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.log"
mkdir -p "$R/gap" "$R/seqs" "$R/heads" "$R/gqa"
timeout 90 python3 benchmarks/backward_gap.py --out "$R/gap" > "$OUT/gap.log" 2>&1
echo "gap exit: $?" >> "$OUT/gap.log"
timeout 100 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 --iters 5 \
  --seq 4096,8192,16384,32768 --bwd-configs "" --out "$R/seqs" > "$OUT/tune.log" 2>&1
timeout 50 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 --heads 64 \
  --bwd-configs "" --out "$R/heads" >> "$OUT/tune.log" 2>&1
timeout 60 python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --causal 1,0 --heads 32 \
  --group 4 --bwd-configs ";fused=0" --out "$R/gqa" >> "$OUT/tune.log" 2>&1
echo "tune exit: $?" >> "$OUT/tune.log"
timeout 90 python3 -m pallas_flash.bench --cases 2x8192x32x8x128 --impls pallas_flash,cudnn \
  --iters 10 --iters-bwd 5 --no-plot --out "$R" > "$OUT/bench.log" 2>&1
echo "bench exit: $?" >> "$OUT/bench.log"

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/tests.log" | tail -12
echo "== gap"; tail -20 "$OUT/gap.log"
echo "== tune"; grep -E "impl=|error|exit" "$OUT/tune.log" | sed -E 's/ config=MosaicBackwardConfig\(.*fused=([A-Za-z]+).*\)/ fused=\1/' | cut -c1-200
echo "== bench"; tail -8 "$OUT/bench.log"
