#!/usr/bin/env bash
# Session 10 (one H200; NOTES.md runs 48-52).
#   usage: bash benchmarks/gpu_session10.sh guard   (~4 min; ran at f2243fb, whose guard_cost.py
#   had --guard-form: "auto"'s guard as a zero-or-one-trip loop after the Mosaic kernel, since
#   reverted to the lax.cond, run 52)
#   - where XLA put each kernel of auto's compiled forward+backward (benchmarks/hlo_kernels.py:
#     the Triton fallback must stay inside the loop);
#   - guard_cost.py: an 8-layer training step, auto with the loop guard ("while") and the
#     former lax.cond ("cond"), forward clusters 1 / 2, against the unchecked mosaic backend;
#   - the compiled guard and dispatch tests (tests/test_backends.py).
#   usage: CASES=... IMPLS=... bash benchmarks/gpu_session10.sh bench   (pipelined benchmark)
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-guard}

if [ "$PART" = guard ]; then
  timeout 120 python3 benchmarks/hlo_kernels.py --shape 2x8192x16x128 --out "$R" \
    > "$OUT/hlo.log" 2>&1; echo "hlo exit: $?" >> "$OUT/hlo.log"
  timeout 200 python3 benchmarks/guard_cost.py --backends auto,mosaic --causal 0 \
    --guard-form while,cond --guarded-cluster 1,2 --out "$R/nc" > "$OUT/guard.log" 2>&1
  echo "guard nc exit: $?" >> "$OUT/guard.log"
  timeout 120 python3 benchmarks/guard_cost.py --backends auto,mosaic --causal 1 \
    --guard-form while,cond --out "$R/c" >> "$OUT/guard.log" 2>&1
  echo "guard c exit: $?" >> "$OUT/guard.log"
  timeout 150 python3 -m pytest -q --compiled -p no:cacheprovider -n 4 --timeout=120 \
    --timeout-method=thread tests/test_backends.py > "$OUT/tests.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/tests.log"
fi

if [ "$PART" = probe ]; then
  # benchmarks/step_probe.py: the backward preprocess's formulations timed alone; the optimized
  # HLO of a 2-layer step under "mosaic" (its forward ran twice a layer in run 49's ncu list);
  # an 8-layer "mosaic" step with and without an optimization_barrier after the forward.
  timeout 90 python3 benchmarks/step_probe.py --part delta > "$OUT/probe.log" 2>&1
  timeout 90 python3 benchmarks/step_probe.py --part hlo --backend mosaic --out "$R" \
    >> "$OUT/probe.log" 2>&1
  timeout 150 python3 benchmarks/step_probe.py --part barrier --layers 8 >> "$OUT/probe.log" 2>&1
  echo "probe exit: $?" >> "$OUT/probe.log"
fi

if [ "$PART" = verify ]; then
  # After the preprocess and barrier changes: the compiled tests that touch them, then the
  # 8-layer step for auto and mosaic, both masks.
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --compiled -p no:cacheprovider -n 6 \
    --timeout=200 --timeout-method=thread tests/test_backends.py tests/test_transforms.py \
    tests/test_gradients.py tests/test_mosaic_fused.py tests/test_mosaic_backward.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/tests.log"
  timeout 150 python3 benchmarks/guard_cost.py --backends auto,mosaic --causal 0,1 \
    --out "$R/step" > "$OUT/guard.log" 2>&1
  echo "guard exit: $?" >> "$OUT/guard.log"
fi

if [ "$PART" = steps ]; then
  # Why an unchecked "mosaic" training step runs ~18% slower than "auto"'s (run 48, and run 14
  # before it), with the same kernels: every kernel launch of a 2-layer step, its duration, per
  # backend (Nsight Compute, one metric; three steps: two warm-ups and one timed).
  for b in auto mosaic; do
    timeout 110 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary \
      per-kernel python3 benchmarks/guard_cost.py --backends $b --causal 0 --layers 2 --iters 1 \
      --out "$R/ncu_$b" > "$OUT/ncu_$b.txt" 2>&1
    echo "ncu exit: $?" >> "$OUT/ncu_$b.txt"
  done
  timeout 60 python3 benchmarks/guard_cost.py --backends auto,mosaic --causal 0 --layers 2 \
    --out "$R/l2" > "$OUT/guard.log" 2>&1
fi

if [ "$PART" = bench ] || [ "$PART" = steps ]; then
  timeout ${BENCH_TIMEOUT:-540} python3 -m pallas_flash.bench --timer pipelined \
    --impls "${IMPLS:-pallas_flash,pallas_flash_mosaic,cudnn}" \
    --cases "${CASES:-2x8192x16x16x128,1x16384x16x16x128}" --iters 20 --iters-bwd 10 \
    --out "$R" > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
fi

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
[ -f "$OUT/probe.log" ] && { echo "== probe"; grep -E "^(delta|hlo|barrier)|exit|Error" "$OUT/probe.log" | cut -c1-400 | head -40; }
[ -f "$OUT/hlo.log" ] && { echo "== hlo"; cut -c1-170 "$OUT/hlo.log" | head -30; }
[ -f "$OUT/guard.log" ] && { echo "== guard"; grep -E "step_ms|error|exit|auto -" "$OUT/guard.log" | sed 's/shape=2x8192x16x128 layers=8 //'; }
[ -f "$OUT/tests.log" ] && { echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit|Error" "$OUT/tests.log" | tail -12; }
for f in "$OUT"/ncu_*.txt; do [ -f "$f" ] && { echo "== $f"; grep -vE "^==PROF==|^\s*$" "$f" | grep -E "exit|pallas|mosaic|triton|copy|fusion|Kernel|gpu__time|Invocations|^\s+[a-z_]+.*\(|loop|input|wrapped" | cut -c1-160 | head -60; }; done
[ -f "$OUT/bench.log" ] && { echo "== bench"; grep -vE "^\s*$" "$OUT/bench.log" | tail -40; }
true
