#!/usr/bin/env bash
# Session 39's refactors (inference mode in every decode, RoundArgs, modules split) against the
# commit before them, bdff633, checked out in a second work tree at $BEFORE, interleaved twice,
# alone on the machine: tokens identical run for run, tok/s within the runs' drift.
set -euo pipefail
cd "$(dirname "$0")/../../.."
scripts/bench_before_after benchmarks/cpu/refactor-39 bench speed \
    --methods ar sd msd --sd-k 4 --msd-n 2 --msd-k 4 \
    --prompts 3 --max-new-tokens 64 --temperatures 0.7 --dtype int8
