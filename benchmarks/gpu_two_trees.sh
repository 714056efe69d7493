#!/usr/bin/env bash
# Two source trees on the two GPUs of nvidia-h200-x2 in one device call: e.g. two branches,
# each a git worktree under scratch/ named in the call's `carry` (session 11 ran main and a
# branch so, runs 53-55).
#   usage: TREE0=scratch/b1 TREE1=scratch/d64 \
#          TEST0="tests/test_mosaic_fused.py" TEST1="tests/test_mosaic_forward.py -k three" \
#          TIME0="python3 benchmarks/mosaic_tune.py ..." TIME1="..." \
#          bash benchmarks/gpu_two_trees.sh
# Phase 1, both trees at once: the compiled tests TEST<i> (pytest arguments; the tests are
# compile-bound, so they share the host well). Phase 2, both trees at once: the timing command
# TIME<i>, each on its own GPU with the rest of the host idle; $RESULTS is its own results
# folder. Compare a tree's numbers with the cuDNN it measured in the same process, not across
# GPUs (run 54: one kernel read 0.88x and 0.99x cuDNN on the two GPUs). Empty TEST<i> / TIME<i>
# skip that part. Limits: TEST_TIMEOUT (240 s), TIME_TIMEOUT (280 s).
source "$(dirname "$0")/gpu_common.sh"

run_tree() {  # $1 = GPU index, $2 = tree, $3 = log, $4 = limit, $5... = command
  local gpu=$1 tree=$2 log=$3 limit=$4
  shift 4
  [ -n "$*" ] || return 0
  (cd "$tree" && mkdir -p "$R/t$gpu" && export CUDA_VISIBLE_DEVICES=$gpu RESULTS="$R/t$gpu" &&
   timeout "$limit" bash -c "$*") > "$OUT/$log" 2>&1
  echo "exit: $?" >> "$OUT/$log"
}

for i in 0 1; do
  tree_var=TREE$i test_var=TEST$i
  [ -n "${!test_var:-}" ] && run_tree $i "${!tree_var:-.}" "tests$i.log" "${TEST_TIMEOUT:-240}" \
    "python3 -m pytest -q --compiled -p no:cacheprovider -n ${WORKERS:-8} --timeout=200 \
     --timeout-method=thread ${!test_var}" &
done
wait
for i in 0 1; do
  tree_var=TREE$i time_var=TIME$i
  [ -n "${!time_var:-}" ] && run_tree $i "${!tree_var:-.}" "time$i.log" "${TIME_TIMEOUT:-280}" \
    "${!time_var}" &
done
wait

tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
for i in 0 1; do
  tree_var=TREE$i
  [ -f "$OUT/tests$i.log" ] && { echo "== tests $i (${!tree_var:-.})";
    grep -E "^(FAILED|ERROR)|passed|failed|exit|Error" "$OUT/tests$i.log" | tail -12; }
  [ -f "$OUT/time$i.log" ] && { echo "== time $i (${!tree_var:-.})";
    grep -vE "^\s*$" "$OUT/time$i.log" | cut -c1-200 | tail -30; }
done
true
