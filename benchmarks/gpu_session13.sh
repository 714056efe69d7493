#!/usr/bin/env bash
# Session 13 (one H200): FlashAttention-3's 128 x 176 forward tile and the fused exponent.
#   usage: bash benchmarks/gpu_session13.sh PART   (PART: a, c, suite, b; see below)
#   Parts a and c as run in runs 64-65, when the forward's default exponent was unfused (since
#   5f8d0d4 it is fused: their ";fused_exponent=1;" lists now time the default thrice).
#   a: compiled tests of the new options; ptxas' report (registers, spills) for the forward's
#      candidate configs; the forward candidates timed alone at head_dim 128 (2 x 8k / 16k x
#      16 heads, causal and not; the default timed twice, first and last, for the drift), and
#      the backward with and without the fused exponent (2 x 8k and 1 x 16k).
#      Run 64: the 176 configs at 240 / 32 registers hung (2 x 240 + 32 > 3 x 168, the launch's
#      registers: forward.register_budget); the tests and the forward sweep ran out of time.
#   c: the same at 240 / 24: ptxas first, then the sweep in two invocations (the safe configs,
#      then the new tiles), the compiled tests, the head_dim 64 / 256 forwards.
#   b: FWD_CONFIGS / BWD_CONFIGS at head_dim 64 and 256; Nsight Compute's warp states and
#      tensor-pipe use for the forward (FWD_NCU configs) and cuDNN's forward, 2 x 8k x 16 x 128.
source "$(dirname "$0")/gpu_common.sh"
PART=${1:-a}
# Run 64 used 240 / 32, which exceeds forward.register_budget(3) and is refused now.
K176="block_kv=176,compute_registers=240,copy_registers=${COPY_REGS:-24}"
FWD128=${FWD128:-";fused_exponent=1;$K176;$K176,fused_exponent=1;block_kv=160,compute_registers=240,copy_registers=24;"}

if [ "$PART" = a ]; then
  timeout 170 python3 -m pytest -q --compiled -p no:cacheprovider -n 8 --timeout=160 \
    --timeout-method=thread tests/test_mosaic_forward.py tests/test_mosaic_backward.py \
    -k "key_blocks or exponent" > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$R/dump" timeout 60 python3 \
    benchmarks/mosaic_ptxas.py --head-dim 128 --configs ";$K176;fused_exponent=1" \
    > "$OUT/ptxas.log" 2>&1
  echo "exit: $?" >> "$OUT/ptxas.log"
  tune fwd128 130 --passes fwd --head-dims 128 --seq 8192,16384 --causal 0,1 \
    --fwd-configs "$FWD128"
  tune bwd128 100 --passes bwd --head-dims 128 --seq 8192 --causal 0,1 \
    --bwd-configs "${BWD128:-;}"
  tune bwd128b1 100 --passes bwd --head-dims 128 --seq 16384 --batch 1 --causal 1,0 \
    --bwd-configs "${BWD128:-;}"
fi

if [ "$PART" = c ]; then
  K176="block_kv=176,compute_registers=240,copy_registers=24"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$R/dump" timeout 70 python3 \
    benchmarks/mosaic_ptxas.py --head-dim 128 \
    --configs ";fused_exponent=1;$K176;$K176,fused_exponent=1" > "$OUT/ptxas_full.log" 2>&1
  echo "exit: $?" >> "$OUT/ptxas_full.log"
  grep -E "^===|ptxas|exit" "$OUT/ptxas_full.log" | cut -c1-220 > "$OUT/ptxas.log"
  rm -f "$OUT/ptxas_full.log"
  tune fwd128 90 --passes fwd --head-dims 128 --seq 8192,16384 --causal 0,1 \
    --fwd-configs ";fused_exponent=1;"
  tune fwd128k 100 --passes fwd --head-dims 128 --seq 8192,16384 --causal 0,1 \
    --fwd-configs "$K176;$K176,fused_exponent=1;block_kv=160,compute_registers=240,copy_registers=24"
  timeout 150 python3 -m pytest -q --compiled -p no:cacheprovider -n 8 --timeout=100 \
    --timeout-method=thread tests/test_mosaic_forward.py tests/test_mosaic_backward.py \
    -k "key_blocks or exponent" > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  tune fwd64 40 --passes fwd --head-dims 64 --seq 8192 --causal 0,1 --fwd-configs ";fused_exponent=1"
  tune fwd256 40 --passes fwd --head-dims 256 --seq 8192 --causal 0,1 \
    --fwd-configs ";fused_exponent=1"
fi

if [ "$PART" = suite ]; then
  # The compiled suite on one GPU, verbose (a run cut by its limit names what passed, and
  # LEFT, a file of node ids, runs the rest in the next call).
  TESTS=(tests)
  [ -n "${LEFT:-}" ] && mapfile -t TESTS < "$LEFT"   # one node id a line (ids hold spaces)
  timeout "${SUITE_TIMEOUT:-530}" python3 -m pytest -v -rfE --compiled -p no:cacheprovider \
    -n "${WORKERS:-14}" --timeout="${TEST_LIMIT:-240}" --timeout-method=thread $IGNORE "${TESTS[@]}" \
    > "$OUT/tests.log" 2>&1
  echo "exit: $?" >> "$OUT/tests.log"
  grep -cE " PASSED " "$OUT/tests.log" > "$OUT/tests_count.txt"
fi

if [ "$PART" = b ]; then
  tune fwd64 80 --passes fwd,bwd --head-dims 64 --seq 8192 --causal 0,1 \
    --fwd-configs "${FWD64:-;fused_exponent=0}" --bwd-configs "${BWD64:-}"
  tune d256 100 --passes fwd,bwd --head-dims 256 --seq 8192 --causal 0,1 \
    --fwd-configs "${FWD256:-;fused_exponent=0}" --bwd-configs "${BWD256:-}"
  MET=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  IFS='|' read -ra NCU_CFGS <<< "${FWD_NCU:-|$K176}"
  for cfg in "${NCU_CFGS[@]}"; do
    echo "=== mosaic fwd [$cfg]" >> "$OUT/ncu.txt"
    timeout 90 ncu --clock-control none -k regex:mosaic_fwd -c 1 --section SpeedOfLight \
      --section WarpStateStats --metrics $MET \
      python3 benchmarks/mosaic_ptxas.py --head-dim 128 --configs "$cfg" >> "$OUT/ncu.txt" 2>&1
    echo "ncu exit: $?" >> "$OUT/ncu.txt"
  done
  echo "=== cudnn fwd" >> "$OUT/ncu.txt"
  timeout 90 ncu --clock-control none -k regex:"fprop|sdpa|flash" -c 1 --section SpeedOfLight \
    --section WarpStateStats --metrics $MET \
    python3 benchmarks/mosaic_tune.py --passes fwd --head-dims 128 --causal 0 --iters 1 \
    --fwd-configs "" --out "$R" >> "$OUT/ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/ncu.txt"
fi

rm -rf "$R/dump"
tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
[ -f "$OUT/tests.log" ] && { echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|exit" \
  "$OUT/tests.log" | tail -12; }
for f in "$OUT"/fwd*.log "$OUT"/bwd*.log "$OUT"/d256.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "impl=|rror|exit" "$f" \
    | sed -E 's/config=Mosaic(Forward|Backward)Config\((.*)\) ms=/cfg[\2] ms=/' \
    | sed -E 's/ (block_q=64|stages=2|pingpong=False|profile_dir=.."|dkdv_block_q=[0-9]+|dq_block_kv=[0-9]+|dkdv_stages=[0-9]|dq_stages=[0-9]|dq_compute_wgs=[0-9]|fused_profile_dir=..|fused_stages=[0-9]|fused_dq_slots=[0-9]|dkdv_paired=False|fused=True|fused_head_chunk=None),?//g' \
    | cut -c1-230; }
done
[ -f "$OUT/ptxas.log" ] && { echo "== ptxas"; grep -E "===|rror|exit|ptxas" "$OUT/ptxas.log" | cut -c1-200; }
[ -f "$OUT/ncu.txt" ] && echo "== ncu" && grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" "$OUT/ncu.txt" \
  | grep -E "===|exit|Throughput|hmma|hit_rate|Duration|Registers|Warp Cycles|Stall|pallas|Elapsed|Issued" \
  | cut -c1-150 | head -90
