#!/usr/bin/env bash
# Session 14 (one H200): session 13's leftovers, then the forward's ordered wgmma issue.
#   usage: bash benchmarks/gpu_session14.sh PART   (PART: a, b, suite; see below)
#   a: the two tests whose workers went down in run 67, by node id, two workers, 240 s each;
#      the pipelined benchmark of README's head_dim 128 cases ("auto" beside cuDNN, the fused
#      exponent now the forward default); Nsight Compute's warp states of our head_dim 128
#      forward (2 x 8k x 16 heads, non-causal) and of cuDNN's.
#   b: (run 69, as run then with the option named tiles_fastest; since renamed head_chunk)
#      the launch order with tiles fastest against sessions 1-13's, kernels alone, forward
#      head_dim 128 / 64 / 256 and backward 256; Nsight Compute's L2 hit rate with it.
#   c: the causal launch order: FlashAttention-3's L2 sections (the default) against one head
#      and all heads a section, forward 128 / 64 / 256 and the head_dim 256 backward; then
#      the compiled forward and two-kernel backward test files.
#   d: the pipelined benchmark of README's head_dim 128 cases; the compiled suite less part
#      c's two files and the multi-device files.
#   suite: as gpu_session13.sh suite.
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-a}

if [ "$PART" = a ]; then
  mapfile -t LEFT < benchmarks/results/left_run67.txt
  timeout 300 python3 -m pytest -v -rfE --compiled -p no:cacheprovider -n 2 --timeout=280 \
    --timeout-method=thread "${LEFT[@]}" > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  timeout 170 python3 -m pallas_flash.bench --timer pipelined --impls pallas_flash,cudnn \
    --iters 20 --iters-bwd 10 --cases 2x8192x16x16x128,1x16384x16x16x128 --no-plot \
    --out "$R/bench" > "$OUT/bench.log" 2>&1
  echo "exit: $?" >> "$OUT/bench.log"
  MET=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  echo "=== mosaic fwd" >> "$OUT/ncu.txt"
  timeout 80 ncu --clock-control none -k regex:mosaic_fwd -c 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --metrics $MET \
    python3 benchmarks/mosaic_ptxas.py --head-dim 128 --configs "" >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
  echo "=== cudnn fwd" >> "$OUT/ncu.txt"
  timeout 80 ncu --clock-control none -k regex:"fprop|sdpa|flash|cudnn" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics $MET \
    python3 benchmarks/mosaic_tune.py --passes fwd --head-dims 128 --causal 0 --iters 1 \
    --fwd-configs "" --out "$R" >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
fi

if [ "$PART" = b ]; then
  # Run 69 (then with tiles_fastest=0 for the old order: now about head_chunk = q heads, which
  # launches one batch's heads per tile where the old order alternated both batches).
  tune fwd128 130 --passes fwd --head-dims 128 --seq 8192,16384 --causal 0,1 \
    --fwd-configs "head_chunk=1;head_chunk=16;head_chunk=1"
  tune fwd64 45 --passes fwd --head-dims 64 --seq 8192 --causal 0,1 \
    --fwd-configs "head_chunk=1;head_chunk=32;head_chunk=1"
  tune fwd256 45 --passes fwd --head-dims 256 --seq 8192 --causal 0,1 \
    --fwd-configs "head_chunk=1;head_chunk=8;head_chunk=1"
  tune bwd256 90 --passes bwd --head-dims 256 --seq 8192 --causal 0,1 \
    --bwd-configs "head_chunk=1;head_chunk=8"
  MET=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  echo "=== mosaic fwd, tiles fastest" >> "$OUT/ncu.txt"
  timeout 60 ncu --clock-control none -k regex:mosaic_fwd -c 1 --section SpeedOfLight \
    --metrics $MET python3 benchmarks/mosaic_ptxas.py --head-dim 128 --configs "" \
    >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
  timeout 150 python3 -m pytest -q --compiled -p no:cacheprovider -n 12 --timeout=140 \
    --timeout-method=thread tests/test_mosaic_forward.py tests/test_mosaic_backward.py \
    -k "cluster or paired or 256" > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
fi

if [ "$PART" = c ]; then
  # Causal: FlashAttention-3's L2 sections (the default) against one head and all heads.
  tune fwd128 100 --passes fwd --head-dims 128 --seq 8192,16384 --causal 1 \
    --fwd-configs ";head_chunk=1;head_chunk=16;"
  tune fwd64 45 --passes fwd --head-dims 64 --seq 8192 --causal 1 \
    --fwd-configs ";head_chunk=1;head_chunk=32;"
  tune fwd256 45 --passes fwd --head-dims 256 --seq 8192 --causal 1 \
    --fwd-configs ";head_chunk=1;head_chunk=8;"
  tune bwd256 60 --passes bwd --head-dims 256 --seq 8192 --causal 1 \
    --bwd-configs ";head_chunk=1;head_chunk=8"
  timeout 300 python3 -m pytest -q --compiled -p no:cacheprovider -n 14 --timeout=240 \
    --timeout-method=thread tests/test_mosaic_forward.py tests/test_mosaic_backward.py \
    > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
fi

if [ "$PART" = d ]; then
  # The pipelined benchmark of README's head_dim 128 cases with the new launch order, then
  # the compiled suite's files that part c did not run (one GPU: no multi-device files).
  timeout 210 python3 -m pallas_flash.bench --timer pipelined --impls pallas_flash,cudnn \
    --iters 20 --iters-bwd 10 --cases 2x8192x16x16x128,1x16384x16x16x128 --no-plot \
    --out "$R/bench" > "$OUT/bench.log" 2>&1
  echo "exit: $?" >> "$OUT/bench.log"
  timeout "${SUITE_TIMEOUT:-330}" python3 -m pytest -q -rfE --compiled -p no:cacheprovider \
    -n 14 --timeout=240 --timeout-method=thread $IGNORE --ignore=tests/test_mosaic_forward.py \
    --ignore=tests/test_mosaic_backward.py tests > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  python3 - "$R"/bench/*.json > "$OUT/bench_table.txt" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
by = {(r["case"], r["causal"], r["impl"]): r for r in rows if r.get("status") == "ok"}
for (case, causal, impl), r in sorted(by.items()):
    if impl != "pallas_flash":
        continue
    c = by.get((case, causal, "cudnn"))
    if c:
        print(case, "causal" if causal else "full", "fwd %.1f/%.1f=%.3f bwd %.1f/%.1f=%.3f" % (
            r["fwd_tflops"], c["fwd_tflops"], r["fwd_tflops"] / c["fwd_tflops"],
            r["bwd_tflops"], c["bwd_tflops"], r["bwd_tflops"] / c["bwd_tflops"]))
PY
fi

if [ "$PART" = suite ]; then
  TESTS=(tests)
  [ -n "${LEFT:-}" ] && mapfile -t TESTS < "$LEFT"
  timeout "${SUITE_TIMEOUT:-530}" python3 -m pytest -v -rfE --compiled -p no:cacheprovider \
    -n "${WORKERS:-14}" --timeout="${TEST_LIMIT:-240}" --timeout-method=thread $IGNORE "${TESTS[@]}" \
    > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  grep -cE " PASSED " "$OUT/tests.log" > "$OUT/tests_count.txt"
fi

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
[ -f "$OUT/tests.log" ] && { echo "== tests"; grep -E "PASSED|^(FAILED|ERROR)|passed|failed|exit" \
  "$OUT/tests.log" | tail -14; }
[ -f "$OUT/bench.log" ] && { echo "== bench"; tail -3 "$OUT/bench.log"; cat "$OUT/bench_table.txt"; }
for f in "$OUT"/fwd*.log "$OUT"/bwd*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "impl=|rror|exit" "$f" \
    | sed -E 's/config=Mosaic(Forward|Backward)Config\((.*)\) ms=/cfg[\2] ms=/' \
    | sed -E 's/ (block_q=64|stages=2|profile_dir=..|copy_registers=[0-9]+|compute_registers=[0-9]+|fused_exponent=True|dkdv_block_q=64|dq_block_kv=128|dkdv_stages=2|dq_stages=2|dq_compute_wgs=[0-9]|fused=False|fused_stages=2|fused_dq_slots=1|fused_profile_dir=..|fused_head_chunk=None|pingpong=False),?//g' \
    | cut -c1-220; }
done
[ -f "$OUT/ncu.txt" ] && echo "== ncu" && grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" "$OUT/ncu.txt" \
  | grep -E "===|exit|Throughput|hmma|hit_rate|Duration|Registers|Warp Cycles|Stall|Elapsed|Issued|Eligible|Active Warps|No Eligible" \
  | cut -c1-150 | head -70
true
