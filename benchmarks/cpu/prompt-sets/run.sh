#!/usr/bin/env bash
# Speed on code, word problems and conversation: one `bench speed` run per prompt set, one after
# another, from the repository root, alone on the machine:
#   bash benchmarks/cpu/prompt-sets/run.sh
# Each run interleaves its methods prompt by prompt; compare ratios to ar within a run.
set -euo pipefail
for set in humaneval gsm8k mt-bench; do
    .venv/bin/smcspec bench speed --methods ar sd smc --sd-k 4 --smc-n 2,4 --smc-k 4,8 \
        --prompt-set "$set" --prompts 5 --max-new-tokens 64 --temperatures 0.7 \
        --out "benchmarks/cpu/prompt-sets/$set"
done
