#!/usr/bin/env bash
# Session 40's refactor (one decode door: `Decoder.decode` runs each method's `_decode(call)`;
# smc's hand-over through `resume`) against the commit before it, c2456e3, checked out in a
# second work tree at $BEFORE, interleaved twice, alone on the machine: tokens identical run for
# run, tok/s within the runs' drift.
set -euo pipefail
cd "$(dirname "$0")/../../.."
scripts/bench_before_after benchmarks/cpu/refactor-40 bench speed \
    --methods ar sd msd smc --sd-k 4 --msd-n 2 --msd-k 4 --smc-n 2 \
    --smc-k 8 --prompts 3 --max-new-tokens 64 --temperatures 0.7 --dtype int8
