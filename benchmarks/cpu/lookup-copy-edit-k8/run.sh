#!/usr/bin/env bash
# Prompt lookup on the copy-edit set (its first 5 requests) at K = 4 and 8, greedy and T = 0.7,
# beside ar, sd and msd with a lookup draft (N = 2): does a longer lookup block pay where the
# answer copies the request?
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods ar sd sd-lookup msd-lookup-draft --sd-k 4,8 --msd-n 2 \
    --prompt-set copy-edit --prompts 5 --temperatures 0,0.7 --max-new-tokens 128 --dtype int8 \
    --out benchmarks/cpu/lookup-copy-edit-k8
