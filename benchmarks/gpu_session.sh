#!/usr/bin/env bash
# One device call on the H200: the compiled test suite, then the benchmark, logs under $OUT.
#   usage: bash benchmarks/gpu_session.sh "<pytest args>" "<bench args>"
# Either part can be skipped by passing "skip". pytest runs with -v, so that a run cut by the
# time limit still lists each finished test (PASSED / FAILED) in tests.log. Only the last lines of output come back from the
# device tool, so each part writes its full log to $OUT and prints a short summary last.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv \
  > "$OUT/gpu.txt" 2>&1
TESTS=${1:-"tests"}
BENCH=${2:-""}
if [ "$TESTS" != "skip" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v --compiled -p no:cacheprovider -n "${WORKERS:-4}" \
    --maxfail=20 $TESTS > "$OUT/tests.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/tests.log"
fi
if [ "$BENCH" != "skip" ]; then
  timeout "${BENCH_TIMEOUT:-280}" python3 -m pallas_flash.bench --out "$OUT" $BENCH \
    > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
fi
[ -f "$OUT/tests.log" ] && grep -E "passed|failed|error|FAILED|ERROR|exit" "$OUT/tests.log" | tail -40
[ -f "$OUT/bench.log" ] && tail -60 "$OUT/bench.log"
