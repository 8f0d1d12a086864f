#!/usr/bin/env bash
# auto before ($BEFORE, a work tree of 5c3ae4d: the tally weighs the whole text alike) and after
# its lookup tally weighs recent positions more (half-life 8 positions), interleaved twice, alone
# on the machine, beside the best fixed exact settings of the earlier runs, each reply ending at
# its EOS, T = 0.7: copy-edit's 20 requests (sd K=8 lookup was best) and HumanEval's first 5
# prompts (sd K=8 lookup and sd K=8 were best).
set -euo pipefail
cd "$(dirname "$0")/../../.."
COMMON="--max-new-tokens 256 --natural-stop --temperatures 0.7 --dtype int8 --sd-k 8"
scripts/bench_before_after benchmarks/cpu/lookup-recency/copy-edit \
    bench speed --methods sd-lookup auto --prompt-set copy-edit --prompts 20 $COMMON
scripts/bench_before_after benchmarks/cpu/lookup-recency/humaneval \
    bench speed --methods sd sd-lookup auto --prompts 5 $COMMON
