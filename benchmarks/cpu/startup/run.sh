#!/usr/bin/env bash
# Warm start-up of `smcspec generate --max-new-tokens 1 hi`, before and after the tokenizer
# store, interleaved, from the repository root, alone on the machine:
#   bash benchmarks/cpu/startup/run.sh BEFORE_COMMIT [COMMIT...] > benchmarks/cpu/startup/runs.md
# BEFORE_COMMIT (with each COMMIT applied on top) runs from a git worktree on the same virtual
# environment and caches; "after" is the working tree.
set -euo pipefail
before=$1
wt=$(mktemp -d)/before
git worktree add -q --detach "$wt" "$before"
[ $# -gt 1 ] && git -C "$wt" cherry-pick --no-commit "${@:2}" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
run() {  # variant, then generate's arguments: one line of the table
    local variant=$1 root=$PWD
    shift
    [ "$variant" = before ] && root=$wt
    local log
    log=$(PYTHONPATH=$root /usr/bin/time -v .venv/bin/smcspec generate "$@" --max-new-tokens 1 hi 2>&1 >/dev/null)
    local wall rss
    wall=$(grep "Elapsed (wall" <<<"$log" | awk '{print $NF}')
    rss=$(grep "Maximum resident" <<<"$log" | awk '{printf "%.2f", $NF / 1048576}')
    echo "| $variant | ${*:-(defaults)} | $wall | $rss |"
}
settings=("" "--method ar" "--dtype int4" "--dtype int4 --method ar")
for s in "${settings[@]}"; do  # warm-up: page cache, stores, kernels
    run before $s >/dev/null
    run after $s >/dev/null
done
echo "| variant | arguments | wall (m:ss) | peak RSS (GiB) |"
echo "| --- | --- | --- | --- |"
for rep in 1 2 3; do
    for s in "${settings[@]}"; do
        run before $s
        run after $s
    done
done
echo
for variant in before after; do
    root=$PWD
    [ "$variant" = before ] && root=$wt
    for dtype in int8 int4; do
        echo "$variant:"
        PYTHONPATH=$root .venv/bin/python "$root/scripts/startup_profile" --dtype "$dtype" 2>/dev/null | grep "^|"
        echo
    done
done
