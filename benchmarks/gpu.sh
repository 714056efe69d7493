#!/usr/bin/env bash
# GPU work on one machine, one entry point:
#
#   bash benchmarks/gpu.sh suite [PYTEST ARGS]    the compiled test suite (default: tests)
#   bash benchmarks/gpu.sh bench [BENCH ARGS]     python -m pallas_flash.bench, pipelined timer,
#                                                 pallas_flash against cuDNN (flags given win)
#   bash benchmarks/gpu.sh tune mosaic|triton|decode [ARGS]   benchmarks/mosaic_tune.py,
#                                                 tune.py or decode_tune.py
#   bash benchmarks/gpu.sh profile [COMMAND...]   Nsight Compute on the kernels of COMMAND
#                                                 (default: one benchmark case)
#   bash benchmarks/gpu.sh huge [ARGS]            benchmarks/huge_check.py (> 2**31 elements)
#   bash benchmarks/gpu.sh scaling [ARGS]         benchmarks/scaling.py (ring attention, all GPUs)
#   bash benchmarks/gpu.sh ring-trace [ARGS]      benchmarks/ring_trace.py (whether the ring's
#                                                 transfers run under its kernels, from a trace)
#   bash benchmarks/gpu.sh train-step [ARGS]      python -m pallas_flash.bench.train_step (a
#                                                 Llama-style training step, attention swapped)
#   bash benchmarks/gpu.sh step-trace [ARGS]      benchmarks/step_trace.py (the kernels of an
#                                                 attention call, forward, backward or both, and
#                                                 their times, from a trace)
#   bash benchmarks/gpu.sh decode-trace [ARGS]    benchmarks/decode_trace.py (the kernels of one
#                                                 decoding step and their times, from a trace)
#
# Logs go to $OUT/NAME.log and results to $OUT/results (gpu_common.sh). Settings, from the
# environment: LIMIT, the seconds a job may run (590). suite: WORKERS pytest-xdist workers
# (default: CPU cores less two) spread over the GPUs, TEST_LIMIT seconds per test (240),
# MULTI_LIMIT for the multi-device files (300); it writes each test phase's seconds to
# $OUT/test_times.tsv. profile: KERNEL, a regex of the kernel names to
# profile (default: every kernel), COUNT kernels profiled (4), METRICS more ncu metrics,
# SOURCE=1 the per-instruction counters too (benchmarks/sass_summary.py; LOOP_LINES of the
# hottest loop printed).
set -u

# Test files that need several devices: run apart, with every GPU visible, when there are two
# or more (one worker of the spread suite sees one GPU, where they skip).
MULTI_FILES=${MULTI_FILES:-"tests/test_sharding*.py tests/test_ring*.py tests/test_sharded_example.py tests/benchmarks/test_scaling_bench.py"}

suite() {
  local gpus workers files=() ignore=()
  gpus=$(gpu_count)
  workers=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
  local pytest=(python3 -m pytest -v -rfE --compiled -p no:cacheprovider
                --timeout="${TEST_LIMIT:-240}" --timeout-method=thread)
  for f in $MULTI_FILES; do [ -f "$f" ] && files+=("$f"); done
  if [ $# -eq 0 ] && [ "$gpus" -gt 1 ]; then
    for f in "${files[@]}"; do ignore+=(--ignore="$f"); done
  fi
  [ $# -eq 0 ] && set -- tests
  # Each test phase's seconds, written as it ends (tests/conftest.py), so a run cut short
  # still shows where its time went.
  export PALLAS_FLASH_TEST_TIMES=${PALLAS_FLASH_TEST_TIMES:-$OUT/test_times.tsv}
  # XLA's GEMM autotuning times candidate algorithms for every float32 reference a test
  # compiles, several seconds a test; the kernels under test are Pallas calls, which it never
  # tunes. Flags set in XLA_FLAGS come after these and win.
  export XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}"
  # tests/conftest.py gives each worker one GPU, in turn.
  [ "$gpus" -gt 1 ] && export PALLAS_FLASH_SPREAD_GPUS=$gpus
  run_logged tests "${LIMIT:-590}" "${pytest[@]}" -n "$workers" "${ignore[@]}" "$@"
  local status=$?
  if [ ${#ignore[@]} -gt 0 ]; then
    unset PALLAS_FLASH_SPREAD_GPUS
    run_logged tests_multi "${MULTI_LIMIT:-300}" "${pytest[@]}" -n 2 "${files[@]}" || status=$?
  fi
  return $status
}

bench() {
  run_logged bench "${LIMIT:-590}" python3 -m pallas_flash.bench --timer pipelined \
    --impls pallas_flash,cudnn --no-plot --out "$RESULTS" "$@"
}

tune() {
  local which=${1:-}
  shift || true
  case "$which" in
    mosaic) run_logged tune_mosaic "${LIMIT:-590}" python3 benchmarks/mosaic_tune.py \
              --out "$RESULTS" "$@" ;;
    triton) run_logged tune_triton "${LIMIT:-590}" python3 benchmarks/tune.py \
              --out "$RESULTS" "$@" ;;
    decode) run_logged tune_decode "${LIMIT:-590}" python3 benchmarks/decode_tune.py \
              --out "$RESULTS" "$@" ;;
    *) echo "usage: gpu.sh tune mosaic|triton|decode [ARGS]" >&2; return 2 ;;
  esac
}

profile() {
  [ $# -eq 0 ] && set -- python3 -m pallas_flash.bench --cases 2x8192x16x16x128 --causal no \
    --impls pallas_flash,cudnn --iters 1 --iters-bwd 1 --no-plot --out "$RESULTS"
  local metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,lts__t_sector_hit_rate.pct${METRICS:+,$METRICS}
  # The clocks stay as the driver sets them, as in every other measurement. XLA's gemm
  # autotuning is off: under ncu its many trial kernels are slow to replay and have crashed the
  # process; the kernels profiled here are ours.
  # SOURCE=1 adds the per-instruction counters: the report is kept, its source page goes to
  # $OUT/source.csv.gz and benchmarks/sass_summary.py's summary of it to the log.
  local report=() rep_dir=""
  if [ -n "${SOURCE:-}" ]; then
    rep_dir=$(mktemp -d)
    report=(--section SourceCounters --section InstructionStats -o "$rep_dir/profile")
  fi
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  run_logged profile "${LIMIT:-590}" ncu --clock-control none -k "regex:${KERNEL:-.}" \
    -c "${COUNT:-4}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --metrics "$metrics" ${report[@]+"${report[@]}"} "$@"
  local status=$?
  if [ -n "$rep_dir" ] && [ -f "$rep_dir/profile.ncu-rep" ]; then
    {
      ncu -i "$rep_dir/profile.ncu-rep" --page details
      ncu -i "$rep_dir/profile.ncu-rep" --page source --csv --print-source sass \
        | gzip > "$OUT/source.csv.gz"
      python3 benchmarks/sass_summary.py "$OUT/source.csv.gz" --loop-lines "${LOOP_LINES:-0}"
    } >> "$OUT/profile.log" 2>&1
  fi
  return $status
}

huge() {
  run_logged huge "${LIMIT:-590}" python3 benchmarks/huge_check.py --out "$RESULTS" "$@"
}

train_step() {
  run_logged train_step "${LIMIT:-590}" python3 -m pallas_flash.bench.train_step \
    --time-limit $(( ${LIMIT:-590} - 50 )) --out "$RESULTS" "$@"
}

scaling() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} \
    run_logged scaling "${LIMIT:-590}" python3 benchmarks/scaling.py --out "$RESULTS" "$@"
}

decode_trace() {
  run_logged decode_trace "${LIMIT:-590}" python3 benchmarks/decode_trace.py --out "$RESULTS" "$@"
}

step_trace() {
  run_logged step_trace "${LIMIT:-590}" python3 benchmarks/step_trace.py --out "$RESULTS" "$@"
}

ring_trace() {
  run_logged ring_trace "${LIMIT:-590}" python3 benchmarks/ring_trace.py --out "$RESULTS" "$@"
}

COMMAND=${1:-}
shift || true
case "$COMMAND" in
  suite|bench|tune|profile|huge|scaling|train-step|ring-trace|step-trace|decode-trace)
    source "$(dirname "$0")/gpu_common.sh"
    record_gpus
    "${COMMAND//-/_}" "$@"
    status=$?
    echo "logs: $OUT"
    exit $status ;;
  *)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2 ;;
esac
