#!/usr/bin/env bash
# Session 15, as run (runs 73-78): what session 14 left (NOTES.md, "Next GPU session").
#   usage: bash benchmarks/gpu_session15.sh PART   (PART: a, b, c, x2, bc, d, e, g, h; below)
#   Parts a and b predate the removal of MosaicForwardConfig.ordered_issue (after run 74).
#   a: the compiled tests session 14 did not finish or add: the ordered-issue forward tests,
#      then the suite less the files runs 70 and 72 ran (run 71's limit cut 28 unnamed
#      tests), verbose, so a cut run names what passed.
#   b: the forward's ordered issue (MosaicForwardConfig.ordered_issue) against the default,
#      kernels alone, head_dim 128 / 64 / 256; the pipelined benchmark with the unguarded
#      Mosaic row beside "auto" and cuDNN (is "auto"'s 0.95x at 2x8k non-causal the guard?).
#   c: Nsight Compute on the fused backward at 1 x 16384 x 16 x 128 causal against cuDNN's
#      backward (tensor pipe, L2 hit rate, warp states): the last unmet target.
#   On nvidia-h200-x2 (lent in session 15):
#   x2: the whole compiled suite, the multi-device files and huge_check.py at once
#       (gpu_session_x2.sh: each pytest worker on one GPU), verbose.
#   d (after run 74; MosaicForwardConfig.ordered_issue removed): on GPU 0 the pipelined
#      benchmark at head_dim 64, 256, GQA 32:8 and again 2x8k head_dim 128 (auto, unguarded
#      Mosaic, cuDNN); on GPU 1 the four tests run 73's limit cut, and the forward's test file
#      compiled (the kernel after the removal).
#   bc: b on GPU 0 and c on GPU 1 at the same time (Nsight Compute replays one kernel at a time
#       on its own GPU; b's timings compare within its own process).
# The four tests run 73's limit cut, by node id.
CUT_TESTS=("tests/test_mosaic_fused.py::test_matches_reference[partial-bottom-right-mqa]"
           "tests/test_mosaic_fused.py::test_matches_reference[turns-d64]"
           "tests/test_properties.py::test_matches_reference[bfloat16]"
           "tests/test_properties.py::test_matches_reference[float16]")
# bench LOG LIMIT ARGS...: the pipelined benchmark, auto and unguarded Mosaic beside cuDNN.
bench() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pallas_flash.bench --timer pipelined \
    --impls pallas_flash,pallas_flash_mosaic,cudnn --iters 20 --iters-bwd 10 --no-plot \
    --out "$R" "$@" > "$OUT/$log.log" 2>&1
  echo "exit: $?" >> "$OUT/$log.log"
}

if [ "${1:-a}" = x2 ]; then
  MOSAIC=skip SCALING=skip BENCH=skip SUITE_TIMEOUT=${SUITE_TIMEOUT:-470} \
    PYTEST_EXTRA="-rfE --timeout=240 --timeout-method=thread" \
    exec bash "$(dirname "$0")/gpu_session_x2.sh"
fi
if [ "${1:-a}" = d ]; then
  source "$(dirname "$0")/gpu_common.sh"
  (
    CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -v -rfE --compiled -p no:cacheprovider \
      -n 4 --timeout=240 --timeout-method=thread "${CUT_TESTS[@]}" > "$OUT/tests_cut.log" 2>&1
    echo "exit: $?" >> "$OUT/tests_cut.log"
  ) &
  CUT=$!
  CUDA_VISIBLE_DEVICES=1 timeout 320 python3 -m pytest -v -rfE --compiled -p no:cacheprovider \
    -n 10 --timeout=240 --timeout-method=thread tests/test_mosaic_forward.py \
    > "$OUT/tests_fwd.log" 2>&1 &
  FWDT=$!
  CUDA_VISIBLE_DEVICES=0 bench bench 330 \
    --cases 2x8192x32x32x64,2x8192x8x8x256,2x8192x32x8x128,2x8192x16x16x128
  wait $FWDT; echo "exit: $?" >> "$OUT/tests_fwd.log"
  wait $CUT
  tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
  for t in "$OUT"/tests*.log; do
    echo "== $t"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$t" | tail -8
  done
  echo "== bench"; tail -32 "$OUT/bench.log"
  exit 0
fi
if [ "${1:-a}" = e ]; then   # what part d's limit cut: two benchmarks, one process per GPU
  source "$(dirname "$0")/gpu_common.sh"
  CUDA_VISIBLE_DEVICES=0 bench bench_gqa 200 --causal yes --cases 2x8192x32x8x128 &
  CUDA_VISIBLE_DEVICES=1 bench bench_128 200 --cases 2x8192x16x16x128
  wait
  tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
  tail -8 "$OUT/bench_gqa.log" "$OUT/bench_128.log"
  exit 0
fi
if [ "${1:-a}" = g ]; then   # the guard at 2x8k non-causal (runs 74/76: auto 3.6-4.7% behind)
  source "$(dirname "$0")/gpu_common.sh"
  C=2x8192x16x16x128
  timeout 120 python3 benchmarks/guard_probe.py --cases $C --causal 0 --sites \
    > "$OUT/probe.log" 2>&1
  echo "probe exit: $?" >> "$OUT/probe.log"
  timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary \
    per-kernel python3 benchmarks/guard_probe.py --cases $C --causal 0 --iters 1 \
    > "$OUT/probe_ncu.log" 2>&1
  echo "ncu exit: $?" >> "$OUT/probe_ncu.log"
  grep -vE "^==PROF==" "$OUT/probe.log" | cut -c1-200 | tail -40
  grep -vE "^==PROF==" "$OUT/probe_ncu.log" | grep -E "^\s+[a-zA-Z_].*\(|Invocations|gpu__time|exit" \
    | cut -c1-160 | head -60
  exit 0
fi
if [ "${1:-a}" = h ]; then   # 2x8k non-causal on a quiet single H200, twice (two processes)
  source "$(dirname "$0")/gpu_common.sh"
  for i in 1 2; do bench "bench_quiet_$i" 100 --causal no --cases 2x8192x16x16x128; done
  tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
  for i in 1 2; do grep -A6 "^case" "$OUT/bench_quiet_$i.log"; tail -1 "$OUT/bench_quiet_$i.log"; done
  exit 0
fi
if [ "${1:-a}" = bc ]; then
  CUDA_VISIBLE_DEVICES=0 bash "$0" b > "${OUT:-/tmp/out}/part_b.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$0" c > "${OUT:-/tmp/out}/part_c.txt" 2>&1
  # Then on GPU 1, the tests run 73's limit cut (part x2), by node id.
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=. timeout 240 python3 -m pytest -v -rfE --compiled \
    -p no:cacheprovider -n 4 --timeout=230 --timeout-method=thread "${CUT_TESTS[@]}" \
    > "${OUT:-/tmp/out}/tests_cut.log" 2>&1
  echo "exit: $?" >> "${OUT:-/tmp/out}/tests_cut.log"
  wait
  tail -8 "${OUT:-/tmp/out}/tests_cut.log"
  cat "${OUT:-/tmp/out}/part_b.txt" "${OUT:-/tmp/out}/part_c.txt"
  exit 0
fi
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-a}
R="$R/$PART"   # parts b and c may run at once (part bc): one results folder each
mkdir -p "$R"; cp "$OUT/r/gpu.txt" "$R/" 2>/dev/null

if [ "$PART" = a ]; then
  timeout 200 python3 -m pytest -v -rfE --compiled -p no:cacheprovider -n 14 --timeout=180 \
    --timeout-method=thread tests/test_mosaic_forward.py -k ordered > "$OUT/tests_ordered.log" 2>&1
  echo "exit: $?" >> "$OUT/tests_ordered.log"
  timeout "${SUITE_TIMEOUT:-360}" python3 -m pytest -v -rfE --compiled -p no:cacheprovider \
    -n 14 --timeout=240 --timeout-method=thread $IGNORE --ignore=tests/test_mosaic_forward.py \
    --ignore=tests/test_mosaic_backward.py --ignore=tests/test_variants.py tests \
    > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
fi

if [ "$PART" = b ]; then
  FWD=${FWD:-";ordered_issue=1;"}   # as run 74 ran it (the field is gone since)
  tune fwd128 130 --passes fwd --head-dims 128 --seq 8192,16384 --causal 0,1 --fwd-configs "$FWD"
  tune fwd64 45 --passes fwd --head-dims 64 --seq 8192 --causal 0,1 --fwd-configs "$FWD"
  tune fwd256 45 --passes fwd --head-dims 256 --seq 8192 --causal 0,1 --fwd-configs "$FWD"
  R="$R/bench" bench bench 260 --cases 2x8192x16x16x128,1x16384x16x16x128
fi

if [ "$PART" = c ]; then
  MET=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  echo "=== mosaic fused bwd" >> "$OUT/ncu.txt"
  timeout 150 ncu --clock-control none -k regex:bwd_fused -c 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --metrics $MET \
    python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --seq 16384 --batch 1 \
    --causal 1 --iters 1 --bwd-configs "" --out "$R" >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
  echo "=== cudnn bwd" >> "$OUT/ncu.txt"
  timeout 150 ncu --clock-control none -k regex:"dgrad|bprop|sdpa|flash|cudnn" -c 3 \
    --section SpeedOfLight --section WarpStateStats --metrics $MET \
    python3 benchmarks/mosaic_tune.py --passes bwd --head-dims 128 --seq 16384 --batch 1 \
    --causal 1 --iters 1 --bwd-configs "" --out "$R" >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
fi

tar -czf "$OUT/results_$PART.tar.gz" -C "$R" . && rm -rf "$R"
for t in "$OUT"/tests*.log; do
  [ -f "$t" ] && { echo "== $t"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$t" | tail -8; }
done
[ -f "$OUT/bench.log" ] && { echo "== bench"; tail -30 "$OUT/bench.log"; }
for f in "$OUT"/fwd*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "impl=|rror|exit" "$f" \
    | sed -E 's/config=MosaicForwardConfig\((.*)\) ms=/cfg[\1] ms=/' \
    | sed -E 's/ (block_q=64|stages=2|profile_dir=..|copy_registers=[0-9]+|compute_registers=[0-9]+|fused_exponent=True|pingpong=False|head_chunk=None),?//g' \
    | cut -c1-220; }
done
[ -f "$OUT/ncu.txt" ] && echo "== ncu" && grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" "$OUT/ncu.txt" \
  | grep -E "===|exit|Throughput|hmma|hit_rate|Duration|Warp Cycles|Eligible|Issued|Active Warps" \
  | cut -c1-150 | head -70
true
