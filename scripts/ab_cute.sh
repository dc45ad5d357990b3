#!/usr/bin/env bash
# A/B of a kernel change in one device call: the carried tree ("new") against the same tree with AB_PATCH reversed
# ("old"), each timing in its own process and DSL cache, alternated new, old, new, old, ... so that clock drift and
# a warm GPU fall on both sides. Then scripts/ab_summary.py prints every cell's rounds and change.
#   git diff > ab.patch  (the change, uncommitted or `git diff HEAD~1`), then on the device:
#   AB_PATCH=ab.patch ROUNDS=2 bash scripts/ab_cute.sh 'python3 scripts/bench_cute.py --dims 64 128 --runners \
#       cute_ws_overlap --json $JSON' 'python3 scripts/time_cute_bwd.py --dims 64 128 --no-cudnn --json $JSON'
# Each argument is one timing command, run with $JSON set to its output file ($OUT/ab_<k>_<side><round>.json).
# env: AB_PATCH (required), ROUNDS (2), AB_TIMEOUT (seconds per command, 200)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
: "${AB_PATCH:?AB_PATCH: the change as a patch against the old tree (git diff)}"
patch=$(realpath "$AB_PATCH")
old=/tmp/ab_old_tree
rm -rf "$old" && cp -r "$PWD" "$old"
(cd "$old" && git apply -R "$patch") || { echo "AB_PATCH does not reverse on this tree"; exit 1; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in new old; do
    tree=$PWD; [ "$side" = old ] && tree=$old
    k=0
    for cmd in "$@"; do
      k=$((k + 1))
      (cd "$tree" && export PYTHONPATH="$tree" CUTE_DSL_CACHE_DIR="/tmp/ab_cache_$side" \
        JSON="$OUT/ab_${k}_${side}${round}.json" && timeout "${AB_TIMEOUT:-200}" bash -c "$cmd" \
        > "$OUT/ab_${k}_${side}${round}.log" 2>&1) || echo "$side round $round command $k failed (log: ab_${k}_${side}${round}.log)"
    done
  done
done
python3 scripts/ab_summary.py "$OUT"
