# Sourced by benchmarks/gpu.sh: the environment every GPU job shares and a runner that logs.
#
# OUT     where logs go (one NAME.log per job, its exit status on the last line) and, under
#         $OUT/results, the JSON the tools write. Default: a fresh folder under /tmp.
# Each job runs under `timeout`, so that one hang costs only its own limit, and its log is
# written as it runs, so that a job cut short still shows how far it got.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
# Comparators a machine without a package index lacks (tokamax and the pure-Python wheels it
# needs): wheels in a .whl/ folder at the repository root are installed once into a folder of
# their own, put first on the path with .whl/stubs (modules imported but never called). Without
# the folder, rows of a comparator that is not installed say so.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if compgen -G "$_root/.whl/*.whl" > /dev/null; then
  _site=${EXTRA_SITE:-/tmp/pallas_flash_extra_site}
  [ -d "$_site" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$_site" "$_root"/.whl/*.whl || echo "gpu_common.sh: installing .whl/ failed" >&2
  export PYTHONPATH="$_site:$_root/.whl/stubs:$PYTHONPATH"
fi
OUT=${OUT:-$(mktemp -d /tmp/pallas_flash_gpu.XXXXXX)}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"

# gpu_count: the GPUs this process may use.
gpu_count() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | wc -l)
  echo "${n:-0}"
}

# record_gpus: name, clocks, temperature and memory in use of every GPU, into $OUT/gpus.txt.
record_gpus() {
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,memory.used \
    --format=csv > "$OUT/gpus.txt" 2>&1 || echo "nvidia-smi failed" > "$OUT/gpus.txt"
}

# run_logged NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT`, its output in $OUT/NAME.log
# and on the terminal; the log ends with "exit: STATUS" (124: cut by the limit).
run_logged() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local status=$?
  echo "exit: $status" | tee -a "$OUT/$name.log"
  return "$status"
}
