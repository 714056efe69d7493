# Sourced by the gpu_session*.sh scripts: the environment and layout every device call shares.
# Sets OUT (the tool's folder), R (JSON results, packed into one results.tar.gz at the end: the
# tool returns at most 8 files), MULTI_FILES (the test files that need several devices) and
# IGNORE (pytest arguments that leave them out), and records the GPUs' state.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
R="$OUT/r"
mkdir -p "$R"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv \
  > "$R/gpu.txt" 2>&1
MULTI_FILES="tests/test_sharding.py tests/test_sharded_example.py tests/test_scaling_bench.py"
IGNORE=$(for f in $MULTI_FILES; do printf -- "--ignore=%s " "$f"; done)

# tune NAME LIMIT ARGS...: benchmarks/mosaic_tune.py ARGS into $R/NAME, its log $OUT/NAME.log.
tune() {  # $1 = log name, $2 = limit, rest = mosaic_tune arguments
  local name=$1 limit=$2
  shift 2
  mkdir -p "$R/$name"
  timeout "$limit" python3 benchmarks/mosaic_tune.py --iters 10 --out "$R/$name" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "exit: $?" >> "$OUT/$name.log"
}
